"""`HostSyncProbe`: count the host syncs of an engine's iteration launches.

A probe that wraps a running `fa3_spec.eagle.EagleEngine` from outside, so the
engine itself carries no measurement switch::

    with HostSyncProbe(engine) as probe:
        engine.run()
    probe.counts  # synchronizing calls per launch: [0, 0, ...] when capture-clean

On CUDA it records synchronizing calls (``torch.cuda.set_sync_debug_mode``,
`fa3_spec.probes.recording_host_syncs`) around each replay of the engine's
runner, which adds host time to every launch it watches; on CPU it records
nothing (``counts`` stays empty).
"""

from __future__ import annotations

from typing import List, Optional

from ..probes import recording_host_syncs


class HostSyncProbe:
    """Synchronizing calls per iteration launch of ``engine``, while the probe is entered.

    Attributes:
        counts: one int per launch watched (CUDA only).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.counts: List[int] = []
        self._replay = None

    @property
    def worst(self) -> Optional[int]:
        """The largest count, or None when no launch was watched."""
        return max(self.counts) if self.counts else None

    def __enter__(self) -> "HostSyncProbe":
        if self._replay is not None:
            raise RuntimeError("this HostSyncProbe is already watching")
        if self.engine.device.type != "cuda":
            return self
        self._replay = list(self.engine.shape_runners.values())  # one per shape it runs
        for runner in self._replay:
            runner.replay = self._watch(runner.replay)
        return self

    def _watch(self, replay):
        def watched(bucket: int, bs: int):
            with recording_host_syncs() as syncs:
                out = replay(bucket, bs)
            self.counts.append(len(syncs))
            return out
        return watched

    def __exit__(self, *exc) -> None:
        if self._replay is not None:
            for runner in self._replay:
                del runner.replay  # the instance attribute: the method shows again
            self._replay = None
