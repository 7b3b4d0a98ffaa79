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
    "Explain {topic} to a curious twelve-year-old.",
    "Write a short, friendly paragraph about {topic}.",
    "What are three common misconceptions about {topic}?",
    "Give me a numbered list of five facts about {topic}.",
    "Summarise the history of {topic} in four sentences.",
    "Write a Python function related to {topic}, with a docstring and one example.",
    "Rewrite this sentence to be more formal: 'honestly, {topic} is kind of a big deal.'",
    "What questions should a beginner ask when learning about {topic}?",
    "Compare {topic} with something from everyday life, in a short analogy.",
    "List the pros and cons of {topic} as a bulleted list.",
    "Write a haiku about {topic}, then explain its imagery.",
    "Draft an email to a colleague proposing a short workshop on {topic}.",
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
    """The training mix: every template over every topic (480 prompts), in a
    fixed order that interleaves the templates."""
    return [t.format(topic=topic) for topic, t in itertools.product(_TRAIN_TOPICS,
                                                                   _TRAIN_TEMPLATES)]


def heldout_prompts() -> List[str]:
    """The held-out set (40 prompts): templates and topics outside the mix."""
    return [t.format(topic=topic) for topic, t in itertools.product(_HELDOUT_TOPICS,
                                                                   _HELDOUT_TEMPLATES)]
