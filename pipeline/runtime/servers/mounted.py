"""The bundles serve mounted for one served model, and the one lookup call every hook's cache
subclass makes (`Mounted.answer`): restored snapshots, the server's own entries and the pinned
bundles under the one rule (pipeline.runtime.lookup), served only while the server runs the
weights the bundles were checked against (`loaded_as_fingerprinted`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.format.fingerprint import folder_state
from pipeline.format.served_identity import changed_message
from pipeline.runtime.lookup import Fetch, lookup_source
from pipeline.runtime.mount import MountResult
from pipeline.runtime.prompt_cache import PromptCacheManager
from pipeline.runtime.snapshots import with_snapshots

log = logging.getLogger("prefix-bundles")
BUNDLE_KEY = "bundles"


@dataclass
class Mounted:
    """The bundles mounted for one served model, pinned in `manager` under BUNDLE_KEY."""

    model: Path
    manager: PromptCacheManager
    result: MountResult
    chat_template: str | None = None  # the template text the server was given, if not the model's
    strict: bool = False  # --strict: a bundle the server will not reuse whole is refused
    # {bundle name: tokens the server's request code keeps}, as check_tokenization found
    reusable: dict[str, int] = field(default_factory=dict)
    # the model folder's files as fingerprinted (fingerprint.folder_state); None: not checked
    state: tuple[str, ...] | None = None
    stale: bool = False  # the folder changed under the server: for the rest of the process
    _checking: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def loaded_as_fingerprinted(self) -> bool:
        """Whether the server runs the weights the bundles were checked against, asked at every
        lookup and before a save (~0.2 ms of stat calls): the files the fingerprints read, and
        every link on the way to them, are as they were when read. Once they are not (a deploy
        swapped weights or flipped a link while serve started or ran: the server may have loaded
        the new ones, at its start or at a reload of its model), what it runs is unknown for the
        rest of the process: every bundle is unpinned, no snapshot is served or saved, one ERROR
        line says so, and the server answers from its own entries only (cold, not wrong)."""
        if self.stale:
            return False
        if self.state is None or folder_state(self.model) == self.state:
            return True
        with self._checking:
            if not self.stale:
                self.stale = True
                for b in list(self.result.bundles):
                    self.manager.unpin(BUNDLE_KEY, b.name)
                self.result.bundles.clear()
                log.error(
                    "%s: no bundle or snapshot is served or saved by this process; restart "
                    "serve", changed_message(self.model, "after serve fingerprinted it"),
                )  # fmt: skip
        return False

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a request the best pinned bundle can serve (no copy)."""
        return self.manager.covered(BUNDLE_KEY, tokens)

    def answer(
        self,
        server: str,
        tokens: Sequence[int],
        own: Fetch,
        batched: bool,
        snapshots: Any = None,
        answered: Callable[[str], None] | None = None,
        bundles: bool = True,
    ) -> tuple[Any, list[int], bool]:
        """The one rule for a request, as every hook's cache subclass asks it: the server's own
        fetch `own`, the restored `snapshots` (`answered(name)` told when one answers) and the
        pinned bundles (`bundles=False`: not them); (cache, tokens left, from a bundle)."""
        if not self.loaded_as_fingerprinted():
            snapshots, bundles = None, False
        fetch = with_snapshots(own, snapshots, self.covered, server, answered)
        return lookup_source(server, self.manager, BUNDLE_KEY, tokens, fetch, batched, bundles)


__all__ = ["BUNDLE_KEY", "Mounted"]
