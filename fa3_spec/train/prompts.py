"""The built-in prompt mix a head trains on when no prompts are given, and a
held-out set for measuring it.

Both come from templates over topics: instructions, questions, code, lists
and rewriting, the kinds of turns a chat model serves. The held-out set uses
other templates and other topics than the training mix, never a prompt of it,
so a figure measured on it is not a figure on the training data.
"""

from __future__ import annotations

import itertools
from typing import List

__all__ = ["builtin_prompts", "heldout_prompts"]

_TRAIN_TEMPLATES = (
    # explanations and questions
    "Explain {topic} to a curious twelve-year-old.",
    "What are three common misconceptions about {topic}?",
    "Summarise the history of {topic} in four sentences.",
    "What questions should a beginner ask when learning about {topic}?",
    "Compare {topic} with something from everyday life, in a short analogy.",
    "How would you explain {topic} to someone who has never heard of it?",
    "What is the single most surprising thing about {topic}?",
    "Answer briefly: how does {topic} affect ordinary people?",
    "I keep hearing about {topic}. Can you give me the basics?",
    # lists and structure
    "Give me a numbered list of five facts about {topic}.",
    "List the pros and cons of {topic} as a bulleted list.",
    "Make a step-by-step guide for getting started with {topic}.",
    "Create a short glossary of five terms related to {topic}.",
    "Outline a one-hour lesson plan about {topic}.",
    "Write three quiz questions about {topic}, with answers.",
    # writing
    "Write a short, friendly paragraph about {topic}.",
    "Write a haiku about {topic}, then explain its imagery.",
    "Draft an email to a colleague proposing a short workshop on {topic}.",
    "Write the opening paragraph of a blog post about {topic}.",
    "Write a short story of about 100 words in which {topic} plays a part.",
    "Write a tweet-length announcement about a new book on {topic}.",
    # rewriting
    "Rewrite this sentence to be more formal: 'honestly, {topic} is kind of a big deal.'",
    "Make this sound more exciting: 'Today we will talk about {topic}.'",
    "Simplify this sentence for a child: 'The ramifications of {topic} are multifaceted.'",
    "Correct the grammar: 'me and my friend was reading about {topic} all day yesterday.'",
    # code
    "Write a Python function related to {topic}, with a docstring and one example.",
    "Write a small Python class that models {topic}, and show how to use it.",
    "Write a SQL table definition for storing information about {topic}.",
    "Write a Python script that prints a short fact about {topic} each time it runs.",
    "Show a JSON object describing {topic}, with at least four fields.",
)

_TRAIN_TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the Roman Empire", "volcanoes",
    "machine learning", "compound interest", "the human heart", "bread baking", "jazz music",
    "plate tectonics", "the printing press", "electric cars", "honeybees", "the immune system",
    "sorting algorithms", "renewable energy", "chess openings", "the French Revolution",
    "coral reefs", "binary numbers", "the moon landing", "coffee roasting", "recycling",
    "the stock market", "climate zones", "sourdough starters", "the Silk Road", "rainbows",
    "hash tables", "bicycle maintenance", "the periodic table", "migrating birds",
    "public libraries", "origami", "the speed of light", "urban gardening", "volunteering",
    "time zones", "the Olympic Games",
    "tides", "the Great Wall of China", "vaccines", "neural networks", "solar panels",
    "the Renaissance", "dinosaurs", "cloud computing", "meditation", "the Amazon rainforest",
    "DNA", "the Industrial Revolution", "electricity", "photography", "rock climbing",
    "chocolate making", "the Internet", "supply and demand", "mushrooms", "lighthouses",
    "the solar system", "recursion", "camping", "knitting", "submarines", "the Vikings",
    "weather forecasting", "board games", "sleep", "bridges", "gravity", "cheese making",
    "the Cold War", "password security", "penguins", "the theory of evolution",
    "opera", "the metric system", "deserts", "video game design", "antibiotics", "kites",
    "the Hanseatic League", "version control", "budgeting", "whales", "the printing of money",
    "skyscrapers", "composting", "the human brain", "trains", "poetry", "Mars exploration",
    "sign language", "the Byzantine Empire", "fermentation", "magnets", "umbrellas",
    "regular expressions", "the ozone layer", "board meetings", "museums", "snowflakes",
    "honey", "the Aztecs", "bird watching", "robots", "the harmonica", "rivers", "job interviews",
    "calendars", "ants", "satellites", "the Pythagorean theorem", "podcasts", "forests",
    "first aid", "the Eiffel Tower", "databases", "octopuses", "street food", "sundials",
    "the Moon's phases", "public speaking", "ancient Greece", "batteries", "hiking trails",
    "glassblowing", "crossword puzzles", "the Mongol Empire",
)

_HELDOUT_TEMPLATES = (
    "Describe a typical day for someone who works with {topic}.",
    "Why does {topic} matter? Answer in two short paragraphs.",
    "Write a JavaScript snippet that has something to do with {topic}, and explain it.",
    "Turn these notes into a clear paragraph: {topic}; useful; often misunderstood; worth learning.",
)

_HELDOUT_TOPICS = (
    "glaciers", "the telephone", "tea ceremonies", "linked lists", "wind turbines",
    "ancient Egypt", "marathon training", "the violin", "earthquakes", "spreadsheets",
)


def builtin_prompts() -> List[str]:
    """The training mix: every template over every topic (30 x 130 = 3,900
    prompts, about 280 KB of text made from 12 KB of source), in a fixed order that interleaves the templates."""
    return [t.format(topic=topic) for topic, t in itertools.product(_TRAIN_TOPICS,
                                                                   _TRAIN_TEMPLATES)]


def heldout_prompts() -> List[str]:
    """The held-out set (40 prompts): templates and topics outside the mix."""
    return [t.format(topic=topic) for topic, t in itertools.product(_HELDOUT_TOPICS,
                                                                   _HELDOUT_TEMPLATES)]
