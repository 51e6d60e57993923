"""The grads' state machine (docs/design.md, "The grads' states"): every move of its table is
made by a real training loop, a move outside the table is refused with both states named, and
random call sequences move as the table says."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import amp_patch as amp
from amp_patch import session as amp_session
from amp_patch.optim.amp.grad_state import MOVES, GradState, GradStateError, GradStates
from amp_patch.optimizers import FusedAdam
from training_utils import mlp, mlp_batch, xent

S = GradState


class Moves:
    """Records every (from, to) that :meth:`GradStates.move` makes."""

    def __init__(self, monkeypatch):
        self.made: list[tuple[GradState, GradState]] = []
        real = GradStates.move

        def move(states, to, why):
            before = states.state
            real(states, to, why)
            self.made.append((before, to))

        monkeypatch.setattr(GradStates, "move", move)


class Loop:
    """One model and optimizer under amp, driven by the calls a training loop makes."""

    def __init__(self, level="O1", fused=False, sync_free=True, optimizers=1):
        self.model = mlp(seed=0, d_in=4, hidden=8, d_out=2)
        params = list(self.model.parameters())
        make = ((lambda ps: FusedAdam(ps, lr=1e-2)) if fused
                else (lambda ps: torch.optim.SGD(ps, lr=1e-2)))
        opts = [make(params)] if optimizers == 1 else [make(params[:2]), make(params[2:])]
        self.model, opts = amp.initialize(self.model, opts, opt_level=level,
                                          half_dtype=torch.float16, loss_scale="dynamic",
                                          sync_free=sync_free, num_losses=2, verbosity=0)
        self.opts = opts
        self.opt = opts[0]
        self.grads = amp_session.current().record_for(self.opt).grads
        self.i = 0

    def block(self, delay=False, inf=False, fail=False, loss_id=0, inside=None):
        self.i += 1
        x, y = mlp_batch(self.i, d_in=4, d_out=2)
        loss = xent(self.model(x), y) * (float("inf") if inf else 1.0)
        with amp.scale_loss(loss, self.opts, loss_id=loss_id, delay_unscale=delay) as scaled:
            scaled.backward()
            if inside is not None:
                inside()
            if fail:
                raise ValueError("boom")

    def failing_block(self, **kw):
        with pytest.raises(ValueError, match="boom"):
            self.block(fail=True, **kw)

    def step(self):
        for opt in self.opts:
            opt.step()

    def zero_grad(self):
        for opt in self.opts:
            opt.zero_grad()

    def clip(self):
        torch.nn.utils.clip_grad_norm_(amp.master_params(self.opt), 1.0)


@pytest.fixture
def moves(monkeypatch):
    yield Moves(monkeypatch)
    amp.deinitialize()


def _close():
    if amp_session.current() is not None:
        amp.deinitialize()


# --------------------------------------------------------------------- loop shapes

def plain(sync_free):
    loop = Loop(sync_free=sync_free)
    loop.step()                      # READY -> STEPPED: a step before any backward
    loop.step()                      # STEPPED -> STEPPED
    loop.block()                     # STEPPED -> STASHED -> UNSCALED (-> SKIP_ON_DEVICE)
    loop.step()
    loop.zero_grad()
    loop.zero_grad()                 # ZEROED -> ZEROED
    loop.block()
    loop.zero_grad()                 # UNSCALED or SKIP_ON_DEVICE -> ZEROED
    return loop


def fresh_zero_grad():
    loop = Loop()
    loop.zero_grad()                 # READY -> ZEROED
    return loop


def one_pass(sync_free):
    loop = Loop("O2", fused=True, sync_free=sync_free)
    loop.zero_grad()
    loop.block()                     # STASHED -> DEFERRED (-> SKIP_ON_DEVICE)
    loop.step()                      # DEFERRED or SKIP_ON_DEVICE -> STEPPED
    loop.block()
    loop.clip()                      # DEFERRED -> UNSCALED (host-read exits)
    loop.step()
    loop.block()
    loop.zero_grad()                 # DEFERRED -> ZEROED (host-read exits)
    return loop


def accumulation(level, fused, sync_free):
    loop = Loop(level, fused=fused, sync_free=sync_free)
    loop.block(delay=True)           # READY -> SCALED
    loop.block(delay=True)           # SCALED -> SCALED
    loop.block()                     # SCALED -> UNSCALED or DEFERRED
    loop.step()
    loop.block(delay=True)           # STEPPED -> SCALED
    loop.zero_grad()                 # SCALED -> SCALED: zeros are scaled grads too
    loop.zero_grad()
    loop.block(delay=True, inside=loop.zero_grad)
    loop.block()
    loop.step()
    loop.zero_grad()
    loop.block(delay=True)           # ZEROED -> SCALED
    loop.block()
    loop.block(delay=True)           # UNSCALED or SKIP_ON_DEVICE -> SCALED
    loop.block()
    loop.step()
    return loop


def two_losses(sync_free):
    loop = Loop(sync_free=sync_free)
    loop.block(loss_id=0)
    loop.block(loss_id=1)            # UNSCALED or SKIP_ON_DEVICE -> STASHED
    loop.step()
    return loop


def two_optimizers():
    loop = Loop(optimizers=2)
    loop.block()
    loop.opts[0].step()
    first, second = (amp_session.current().record_for(o).grads for o in loop.opts)
    assert (first.state, second.state) == (S.STEPPED, S.SKIP_ON_DEVICE)
    loop.opts[1].step()
    return loop


def skipped_step(fused, sync_free):
    loop = Loop("O2", fused=fused, sync_free=sync_free)
    loop.block(inf=True)             # -> SKIP_ON_HOST (host read) or SKIP_ON_DEVICE
    loop.block(loss_id=1)            # SKIP_ON_* -> STASHED; the verdict stays for the step
    assert loop.grads.skip_pending
    loop.step()                      # skipped
    loop.block(inf=True)
    loop.block(delay=True)           # SKIP_ON_* -> SCALED
    loop.block()
    loop.step()
    loop.block(inf=True)
    loop.zero_grad()                 # SKIP_ON_* -> ZEROED; the verdict stays (as in Apex)
    assert loop.grads.skip_pending
    loop.step()
    assert not loop.grads.skip_pending
    return loop


def exceptions(sync_free):
    loop = Loop(sync_free=sync_free)
    loop.failing_block()             # STASHED -> READY
    loop.step()
    loop.failing_block()             # STASHED -> STEPPED
    loop.zero_grad()
    loop.failing_block()             # STASHED -> ZEROED
    loop.block()
    loop.failing_block()             # STASHED -> UNSCALED or SKIP_ON_DEVICE
    loop.step()
    loop.block(inf=True)
    loop.failing_block()             # STASHED -> SKIP_ON_HOST or SKIP_ON_DEVICE
    loop.step()
    loop.block(delay=True)
    loop.failing_block()             # SCALED -> SCALED
    loop.failing_block(delay=True)   # a delayed block moves nothing
    loop.block()
    loop.block(inside=loop.zero_grad)  # STASHED -> STASHED
    loop.block(inside=loop.step)       # STASHED -> STASHED: a step inside the block
    loop.step()
    return loop


SHAPES = {
    "plain sync_free": lambda: plain(True),
    "plain host read": lambda: plain(False),
    "zero_grad first": fresh_zero_grad,
    "one-pass O2 sync_free": lambda: one_pass(True),
    "one-pass O2 host read": lambda: one_pass(False),
    "accumulation O1 sync_free": lambda: accumulation("O1", False, True),
    "accumulation O1 host read": lambda: accumulation("O1", False, False),
    "accumulation O2 one-pass": lambda: accumulation("O2", True, True),
    "two losses sync_free": lambda: two_losses(True),
    "two losses host read": lambda: two_losses(False),
    "two optimizers": two_optimizers,
    "skipped step SGD host read": lambda: skipped_step(False, False),
    "skipped step SGD sync_free": lambda: skipped_step(False, True),
    "skipped step one-pass host read": lambda: skipped_step(True, False),
    "skipped step one-pass sync_free": lambda: skipped_step(True, True),
    "exceptions sync_free": lambda: exceptions(True),
    "exceptions host read": lambda: exceptions(False),
}


@pytest.fixture(scope="module")
def made_by_shape():
    made: dict[str, set[tuple[GradState, GradState]]] = {}
    with pytest.MonkeyPatch.context() as mp:
        recorder = Moves(mp)
        for name, shape in SHAPES.items():
            recorder.made.clear()
            try:
                shape()
            finally:
                _close()
            made[name] = set(recorder.made)
    return made


@pytest.mark.parametrize("move", sorted(MOVES, key=lambda m: (m[0].name, m[1].name)),
                         ids=lambda m: f"{m[0]}->{m[1]}")
def test_every_legal_move_is_made_by_a_real_loop(made_by_shape, move):
    shapes = [name for name, made in made_by_shape.items() if move in made]
    assert shapes, f"no loop shape makes {move[0]} -> {move[1]} ({MOVES[move]})"


def test_the_loops_make_only_legal_moves(made_by_shape):
    for name, made in made_by_shape.items():
        assert made <= set(MOVES), name


def test_plain_loop_states(moves):
    loop = Loop(sync_free=True)
    seen = [loop.grads.state]
    loop.block(inside=lambda: seen.append(loop.grads.state))
    seen.append(loop.grads.state)
    loop.step()
    seen.append(loop.grads.state)
    loop.zero_grad()
    seen.append(loop.grads.state)
    assert seen == [S.READY, S.STASHED, S.SKIP_ON_DEVICE, S.STEPPED, S.ZEROED]
    assert moves.made == [(S.READY, S.STASHED), (S.STASHED, S.UNSCALED),
                          (S.UNSCALED, S.SKIP_ON_DEVICE), (S.SKIP_ON_DEVICE, S.STEPPED),
                          (S.STEPPED, S.ZEROED)]


def test_one_pass_sync_free_step_reads_nothing_and_keeps_scaled_grads(moves):
    loop = Loop("O2", fused=True, sync_free=True)
    loop.zero_grad()
    loop.block()
    record = amp_session.current().record_for(loop.opt)
    assert loop.grads.state is S.SKIP_ON_DEVICE
    assert record._deferred_grads is not None      # still scaled: the step unscales them
    assert isinstance(loop.grads.found_inf, torch.Tensor)
    loop.step()
    assert loop.grads.state is S.STEPPED and loop.grads.found_inf is None


def test_accumulation_reports_scaled_grads_to_apex_stash(moves):
    loop = Loop()
    stash = loop.opt._amp_stash
    loop.block(delay=True)
    assert loop.grads.state is S.SCALED and stash.params_have_scaled_gradients
    loop.block()
    assert not stash.params_have_scaled_gradients


@pytest.mark.parametrize("sync_free", [True, False])
def test_an_overflow_skips_the_step_however_many_blocks_follow(moves, sync_free):
    loop = Loop(sync_free=sync_free)
    loop.block(inf=True)
    assert loop.grads.state is (S.SKIP_ON_DEVICE if sync_free else S.SKIP_ON_HOST)
    loop.block(loss_id=1)
    before = [p.detach().clone() for p in loop.model.parameters()]
    assert loop.opt._amp_stash.already_patched
    loop.step()
    assert all(torch.equal(p, q) for p, q in zip(loop.model.parameters(), before))
    assert loop.grads.pending_skip is None and not loop.opt._amp_stash.already_patched


def test_a_checkpoint_load_mid_accumulation_keeps_the_window_and_the_verdict(moves, tmp_path):
    from amp_patch.frontend.checkpoint import load_checkpoint, save_checkpoint

    loop = Loop("O2", fused=True, sync_free=True)
    save_checkpoint(tmp_path / "ckpt", loop.model, loop.opt)
    loop.block(inf=True)
    loop.block(delay=True)
    assert loop.grads.state is S.SCALED
    load_checkpoint(tmp_path / "ckpt", loop.model, loop.opt)  # a fresh optimizer: a zero-lr step
    assert loop.grads.state is S.SCALED
    assert loop.grads.pending_skip is S.SKIP_ON_DEVICE and loop.grads.skip_pending
    loop.block()
    loop.step()
    assert loop.grads.state is S.STEPPED


# --------------------------------------------------------------------- illegal moves

ILLEGAL = [(a, b) for a, b in itertools.product(GradState, GradState) if (a, b) not in MOVES]


@pytest.mark.parametrize("move", ILLEGAL, ids=lambda m: f"{m[0]}->{m[1]}")
def test_an_illegal_move_raises_naming_both_states(move):
    old, to = move
    grads = GradStates("SGD")
    grads.state = old
    with pytest.raises(GradStateError) as info:
        grads.move(to, "the call tried")
    message = str(info.value)
    assert f"from {old.name} to {to.name}" in message and "the call tried" in message
    assert "SGD" in message and grads.state is old
    assert isinstance(info.value, RuntimeError)


def test_an_exit_without_its_entry_is_refused(moves):
    loop = Loop()
    record = amp_session.current().record_for(loop.opt)
    with pytest.raises(GradStateError, match="from READY to UNSCALED"):
        record.collect_unscale([], ([], []), ([], []))
    loop.step()
    with pytest.raises(GradStateError, match="from STEPPED to SKIP_ON_HOST"):
        record.schedule_skip(True)


def test_deinitialize_starts_afresh(moves):
    loop = Loop()
    loop.block(inf=True)
    grads = loop.grads
    amp.deinitialize()
    assert grads.state is S.READY and grads.pending_skip is None


# --------------------------------------------------------------------- random call sequences

ACTIONS = ["block", "delay", "inf", "fail", "step", "zero_grad", "clip"]


def _expected(action, state):
    """The state the table gives for ``action`` from ``state`` (docs/design.md's list); the
    checked exits ("block", "inf") are checked by what they must end in instead."""
    inside = state in (S.STASHED, S.SCALED)
    if action in ("step", "zero_grad"):
        return state if inside else (S.STEPPED if action == "step" else S.ZEROED)
    if action == "delay":
        return S.SCALED
    # master_params() unscales deferred grads; so does an entry, which a failing block undoes.
    return S.UNSCALED if state is S.DEFERRED else state


@settings(max_examples=25, deadline=None)
@given(fused=st.booleans(), sync_free=st.booleans(),
       actions=st.lists(st.sampled_from(ACTIONS), max_size=10))
def test_random_call_sequences_move_as_the_table_says(fused, sync_free, actions):
    loop = Loop("O2" if fused else "O1", fused=fused, sync_free=sync_free)
    try:
        for action in actions:
            before = loop.grads.state
            assert before is not S.DEFERRED or fused, "only the one-pass step defers"
            expected = None if action in ("block", "inf") else _expected(action, before)
            {"block": loop.block, "delay": lambda: loop.block(delay=True),
             "inf": lambda: loop.block(inf=True), "fail": loop.failing_block,
             "step": loop.step, "zero_grad": loop.zero_grad, "clip": loop.clip}[action]()
            after = loop.grads.state
            if expected is not None:
                assert after is expected, (action, before, after)
            if action in ("block", "inf"):
                assert after in (S.UNSCALED, S.DEFERRED, S.SKIP_ON_DEVICE, S.SKIP_ON_HOST)
                if action == "inf":
                    assert after in (S.SKIP_ON_DEVICE, S.SKIP_ON_HOST) and loop.grads.skip_pending
                assert (after is S.SKIP_ON_DEVICE) == (
                    sync_free and loop.grads.pending_skip is S.SKIP_ON_DEVICE)
            if action == "step":
                assert loop.grads.pending_skip is None
    finally:
        amp.deinitialize()
