"""The fused decoding step (ops/causal_rfa/fused.py) against its reference, recurrent_causal_rfa_step after the
beam's gather: outputs and states, over gates, pads, beam reorders and a batch that shrinks."""
import pytest
import torch

from rfa_fairseq import extensions
from rfa_fairseq.ops import recurrent_causal_rfa_step
from rfa_fairseq.ops.causal_rfa import fused
from rfa_fairseq.ops.causal_rfa.fused import fused_causal_rfa_step

pytestmark = pytest.mark.skipif(fused.load() is None, reason="the fused op could not be compiled here")
H, Fd, K = 3, 10, 7


@pytest.mark.parametrize("gate", [None, "convex", "decay"])
def test_fused_steps_equal_the_gather_then_the_recurrent_step(gate):
    g = torch.Generator().manual_seed(0)
    state = ref = torch.randn(6, H, Fd, K + 1, generator=g)
    spare = torch.empty(6, H, Fd, K + 1)
    parents_each_step = [torch.tensor([1, 1, 0, 3, 5, 4]), None, torch.tensor([2, 0, 0, 1]), torch.tensor([3, 3])]
    with torch.no_grad():
        for parents in parents_each_step:
            B = len(parents) if parents is not None else state.size(0)
            q, k = torch.rand(2, B, H, Fd, generator=g).unbind(0)
            k[0] = 0.0  # a pad writes nothing
            v = torch.randn(B, H, K, generator=g)
            log_g = None if gate is None else torch.nn.functional.logsigmoid(torch.randn(B, H, generator=g))
            if log_g is not None:
                log_g[0] = 0.0  # and does not decay
            gathered = ref if parents is None else ref.index_select(0, parents)
            want, ref = recurrent_causal_rfa_step(q, k, v, log_g, gathered.clone(), convex=gate != "decay")
            got, new = fused_causal_rfa_step(q, k, v, log_g, state, parents, spare[:B], 1e-2, convex=gate != "decay")
            assert new.data_ptr() == spare.data_ptr()  # written into the spare buffer, the old state left as it was
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-6)
            state, spare = new, state


def test_the_fused_op_refuses_a_parent_out_of_range():
    state, spare = torch.zeros(2, H, Fd, K + 1), torch.zeros(2, H, Fd, K + 1)
    q = k = torch.zeros(2, H, Fd)
    with torch.no_grad(), pytest.raises(RuntimeError, match="parent out of range"):
        fused_causal_rfa_step(q, k, torch.zeros(2, H, K), None, state, torch.tensor([0, 2]), spare, 1e-2)


def test_deferral_and_the_fused_op_only_without_autograd_on_float32_cpu_states():
    s = torch.zeros(1, H, Fd, K + 1)
    with torch.no_grad():
        assert fused.usable(s) and not fused.usable(s.double()) and not fused.usable(None)
    assert not fused.deferrable(s)  # autograd on


def test_without_a_compiler_one_warning_then_torchs_operators(monkeypatch):
    import torch.utils.cpp_extension

    def fail(*args, **kwargs):
        raise OSError("no compiler")
    monkeypatch.setattr(extensions, "_built", {})
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    with pytest.warns(UserWarning, match="could not be compiled.*no compiler"):
        assert fused.load() is None
    with torch.no_grad():
        assert not fused.usable(torch.zeros(1, H, Fd, K + 1))


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(monkeypatch, tmp_path):
    """torch's extension build waits for its lock file to go; one left by a killed build would hang every later
    process, so a lock older than ten minutes is removed (a fresh one belongs to a build under way)."""
    import os
    import time
    import torch.utils.cpp_extension as ext
    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(ext, "load", lambda *a, **kw: "op")
    lock = tmp_path / "lock"
    for age, kept in ((3600, False), (5, True)):
        lock.touch()
        os.utime(lock, (time.time() - age,) * 2)
        monkeypatch.setattr(extensions, "_built", {})
        assert fused.load() == "op" and lock.exists() == kept
