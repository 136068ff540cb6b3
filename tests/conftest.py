"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest

from testing.launch import use_forkserver

# Every process the tests start keeps NCCL's point-to-point rules on gloo (engine/p2p_rules.py): a pipeline
# that would hang on a GPU cluster fails here. ``ZORSE_P2P_RULES=gloo make test`` runs with gloo's own.
os.environ.setdefault("ZORSE_P2P_RULES", "nccl")

# Ranks of spawn_ranks are forked from one process that imported torch and Lightning once for the session
# (testing/launch.py): a spawned rank pays those imports again, 26-30 s for four ranks on two cores.
use_forkserver()


@pytest.fixture
def run_app(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """Run a Hydra app's ``main`` in this process with the given command line: (exit code, stdout, stderr)."""

    def run(main: Callable[[], None], *args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["app", *args])
        code = 0
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
