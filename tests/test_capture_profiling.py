"""refcheck.sglang.capture.profiling: the opt-in profiler window over a scheduler's traced batches (CPU)."""

from __future__ import annotations

import pytest
import torch

from refcheck.sglang.capture import profiling


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(profiling, "_state", profiling._State())


def test_window_parses_first_and_count_and_refuses_anything_else():
    assert profiling.window(None) is None and profiling.window("") is None
    assert profiling.window("3:5") == (3, 5)
    for bad in ("3", "a:b", "-1:2", "0:0", "1:2:3"):
        with pytest.raises(ValueError, match="REFCHECK_CAPTURE_PROFILE"):
            profiling.window(bad)


def test_without_the_variable_nothing_is_profiled(fresh, monkeypatch, tmp_path):
    monkeypatch.delenv(profiling.ENV_PROFILE, raising=False)
    for _ in range(4):
        profiling.tick(tmp_path, 0)
        with profiling.section("after"):
            pass
    assert profiling._state.prof is None and not list(tmp_path.iterdir())


def test_the_window_covers_count_batches_and_labels_the_sections(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv(profiling.ENV_PROFILE, "1:2")
    for k in range(5):
        profiling.tick(tmp_path, 0)
        with profiling.section("state"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        assert (profiling._state.prof is not None) == (k in (1, 2)), k
    (out,) = tmp_path.glob("profile-rank0-pid*.txt")
    text = out.read_text()
    assert text.startswith("profiled window: traced batches 1..2") and "refcheck.state" in text


def test_the_allocator_section_gives_each_counters_change_per_batch_and_the_memory_at_both_ends():
    """allocator_text: retries, OOMs, cudaMalloc and cudaFree calls over the window (and per batch), then reserved,
    allocated and free memory at its start and end; without CUDA it says there is nothing to report."""
    mib = 2 ** 20
    before = {"num_alloc_retries": 2, "num_ooms": 0, "num_device_alloc": 10, "num_device_free": 1,
              "reserved_bytes": 1000 * mib, "allocated_bytes": 600 * mib, "free_bytes": 141 * mib,
              "total_bytes": 81080 * mib}
    after = {**before, "num_alloc_retries": 42, "num_device_alloc": 50, "num_device_free": 41,
             "allocated_bytes": 700 * mib}
    text = profiling.allocator_text(before, after, 20)
    assert "num_alloc_retries: +40 (2.00 per batch)" in text and "num_ooms: +0 (0.00 per batch)" in text
    assert "num_device_free: +40 (2.00 per batch)" in text and "allocated MiB: 600 -> 700" in text
    assert "free MiB: 141 -> 141" in text and "device total MiB: 81080" in text
    assert "nothing to report" in profiling.allocator_text({}, {}, 20)
    if not torch.cuda.is_available():
        assert profiling.allocator_stats() == {}
