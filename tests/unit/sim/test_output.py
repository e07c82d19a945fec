"""The simulator's output explains itself: counts for rare CP sizes, plurals, where the long
documents are, a warning for batches too small to use the ranks, and what latency means."""

from __future__ import annotations

import numpy as np

from dyncp.sim.__main__ import _latency_note
from dyncp.sim.replay import batch_notes, plural
from dyncp.sim.report import _mix


def test_rare_cp_sizes_show_a_count_instead_of_zero_percent() -> None:
    assert _mix({"1": 9990, "16": 3, "32": 7}, 10000) == "1:99.9% 16:3 seq 32:0.1%"
    assert _mix({"1": 5, "2": 5}, 10) == "1:50.0% 2:50.0%"


def test_plural() -> None:
    assert plural(1, "document") == "1 document"
    assert plural(12000, "document") == "12,000 documents"


def test_batch_notes_name_the_steps_of_the_longest_documents() -> None:
    batches = [np.array([5, 9]), np.array([700, 3]), np.array([40]), np.array([700])]
    notes = batch_notes(batches, world=2)
    assert notes[0] == (
        "longest documents: 700 tokens (step 1), 700 tokens (step 3), 40 tokens (step 2)"
    )
    assert len(notes) == 2 and notes[1].startswith("warning: 1.5 documents per step on 2 ranks")
    assert len(batch_notes(batches, world=1)) == 1


def test_the_latency_note_names_the_planning_mode() -> None:
    assert _latency_note(None).startswith("planners: deterministic")
    assert "--time-limit 0.1" in _latency_note(None)
    assert "0.25 s wall-clock deadline" in _latency_note(0.25)
