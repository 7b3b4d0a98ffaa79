"""The library's test support: how fa3_spec proves itself. Not imported by the library.

The ``fa3-spec audit`` command (`fa3_spec.cli`), the tests, the notebooks and the
benchmarks use it.

* `worlds`: synthetic paged serving worlds (``make_world``, ``fill_kv_cache``).
* `oracle`: the dense key-set oracle and metadata comparators.
* `upstream`: a host-synced upstream-style builder (+ the #27360 switch).
* `toy`: a toy attention-only model and the whole steps a runner captures.
* `selfaudit`: the audit grid over every builder and step (`fa3_spec.audit`).
* `sglang_upstream`: sglang 0.5.23's own metadata code, fetched from its wheel
  at run time and run against small stubs (never committed); on CPU the
  process must start with ``TRITON_INTERPRET=1``.

Arrows run from here to the library only (``compile_tests/test_layers.py``).
"""
