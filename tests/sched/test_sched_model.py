"""The modelled parts of the scheduler simulation, in isolation (no vLLM, no
LMCache): the worker's block writes (sched_truth) and the server's store and
lookup semantics (sched_server).  Each case is a hand-worked vLLM 0.27.1
align-mode situation with a tiny block (N = 4)."""

from __future__ import annotations

from types import SimpleNamespace


from lab.sched_server import FakeServer, ServerRules
from lab.sched_truth import (
    NULL_BLOCK, DraftState, StepInput, Truth)

N = 4
MAMBA, FA = 0, 1


def digest(rid: str, t: int) -> tuple[str, int]:
    return ("seq", t)  # every request here shares one token sequence


def no_lists(rid: str) -> None:
    return None


def new_request(truth: Truth, rid: str, mamba: list[int], fa: list[int]) -> None:
    so = SimpleNamespace(
        finished_req_ids=set(), preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=([*mamba], [*fa]))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[]))
    truth.update_tables(so)


def test_multi_block_prefill_step_writes_state_only_into_its_last_block():
    """A 3-block step (12 tokens): vLLM lists [null, null, 7] for the Mamba
    group; the state after 12 tokens lands in block 7, nothing else holds one."""
    truth = Truth(N, [MAMBA], [FA], num_spec=0)
    new_request(truth, "A", [NULL_BLOCK, NULL_BLOCK, 7], [1, 2, 3])
    truth.apply([StepInput("A", 0, 12, [], None)], digest, no_lists)
    assert truth.mamba == {7: ("seq", 12)}
    assert truth.materialized["A"] == {12}
    assert [truth.fa_digest(b, digest) for b in (1, 2, 3)] == [("seq", 4), ("seq", 8), ("seq", 12)]
    assert truth.mamba_content(NULL_BLOCK) is None and not truth.inconsistencies


def test_spec_decode_copies_the_crossed_boundary_state_into_its_block():
    """3 committed tokens, then [last, d1, d2] with both drafts accepted: the
    running slot moves to block index 1 (pre-copy), the forward writes the
    states after 4, 5, 6 tokens into slots 1..3, and the postprocess copies
    the state after exactly 4 tokens (a block boundary) into slot 0."""
    truth = Truth(N, [MAMBA], [FA], num_spec=2)
    new_request(truth, "A", [10, 11, 12], [20, 21])
    truth.apply([StepInput("A", 0, 3, [], 0)], digest, no_lists)  # prefill; samples
    assert truth.mamba[10] == ("seq", 3)
    truth.tables["A"][MAMBA].append(13)  # vLLM's new running/spec ids
    truth.apply([StepInput("A", 3, 3, [91, 92], 2)], digest, no_lists)
    assert truth.mamba[10] == ("seq", 4)  # boundary copy (postprocess)
    assert [truth.mamba[b] for b in (11, 12, 13)] == [("seq", 4), ("seq", 5), ("seq", 6)]
    assert not truth.inconsistencies


def test_rejected_drafts_leave_draft_state_and_invalid_fa_positions():
    truth = Truth(N, [MAMBA], [FA], num_spec=2)
    new_request(truth, "A", [10, 11, 12], [20, 21])
    truth.apply([StepInput("A", 0, 3, [], 0)], digest, no_lists)
    truth.apply([StepInput("A", 3, 3, [91, 92], 0)], digest, no_lists)  # both rejected
    assert isinstance(truth.mamba[12], DraftState)
    assert truth.fa[20].hi == N  # block 0 complete: positions 0..3 committed
    assert truth.fa[21].hi == N  # block 1 holds only rejected drafts: nothing valid
    assert truth.fa_digest(21, digest) is None


def test_a_wrong_running_state_is_reported_as_a_model_inconsistency():
    truth = Truth(N, [MAMBA], [FA], num_spec=0)
    new_request(truth, "A", [10], [20, 21])
    truth.apply([StepInput("A", 0, 4, [], None)], digest, no_lists)
    truth.mamba[10] = ("other", 4)  # as if another request had overwritten it
    truth.tables["A"][MAMBA].append(11)
    truth.apply([StepInput("A", 4, 4, [], None)], digest, no_lists)
    assert truth.inconsistencies and "running state" in truth.inconsistencies[0]


def _server(objects: str, keep_all: bool = False) -> FakeServer:
    rules = ServerRules(mamba_keep_blocks=(lambda bpc: bpc) if keep_all else (lambda bpc: 1),
                        skips_all_null=True, objects=objects)
    return FakeServer(N, 2 * N, [MAMBA], [FA], rules)


def _prefilled(step_blocks: int) -> Truth:
    """4 blocks prefilled in steps of ``step_blocks`` blocks (ids 10.. / 20..)."""
    truth = Truth(N, [MAMBA], [FA], num_spec=0)
    mamba = [NULL_BLOCK if (i + 1) % step_blocks else 10 + i for i in range(4)]
    new_request(truth, "A", mamba, [20, 21, 22, 23])
    for lo in range(0, 4, step_blocks):
        truth.apply([StepInput("A", lo * N, step_blocks * N, [], None)], digest, no_lists)
    return truth


def test_merged_objects_commit_the_null_block_as_a_chunks_state():
    """C = 2N, 4-block prompt in 1-block steps, then a chunk whose end slot is
    null (as in a multi-block step): merged objects store it with a wrong state."""
    truth = _prefilled(1)
    server = _server("merged")
    server.store("A", 0, 4 * N, [[10, NULL_BLOCK, 12, 13], [20, 21, 22, 23]], truth, digest)
    first, second = server.writes
    assert first.wrong_state and first.fa_ok and not second.wrong_block
    prompt = [("seq", t) for t in range(4 * N + 1)]
    hit, boundary = server.hit(prompt)
    assert hit == 4 * N and boundary is second
    assert server.hit(prompt[:2 * N + 1]) == (2 * N, first)  # a wrong-state hit


def test_separate_objects_skip_a_null_state_and_cut_the_hit_back():
    truth = _prefilled(1)
    server = _server("separate")
    server.store("A", 0, 4 * N, [[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 13],
                                 [20, 21, 22, 23]], truth, digest)
    assert len(server.fa_objects) == 2 and len(server.mamba_objects) == 1
    assert not any(w.wrong_block for w in server.writes)
    prompt = [("seq", t) for t in range(4 * N + 1)]
    assert server.hit(prompt)[0] == 4 * N
    assert server.hit(prompt[:3 * N + 1]) == (0, None)  # chunk 0 has no state object


def test_053_reads_every_mamba_block_of_a_chunk():
    """sw_size_tokens = -1 (pristine 0.5.3): a null mid-chunk slot is read too."""
    truth = _prefilled(1)
    server = _server("merged", keep_all=True)
    server.store("A", 0, 2 * N, [[NULL_BLOCK, 11], [20, 21]], truth, digest)
    (w,) = server.writes
    assert w.mamba_end_ok and not w.mamba_mid_ok and w.wrong_block and not w.wrong_state


def test_first_write_of_a_key_wins():
    truth = _prefilled(1)
    server = _server("merged")
    server.store("A", 0, 2 * N, [[10, 11], [20, 21]], truth, digest)
    server.store("A", 0, 2 * N, [[10, NULL_BLOCK], [20, 21]], truth, digest)
    assert server.duplicate == 1
    assert not server.fa_objects[("seq", 2 * N)].wrong_block


def test_a_load_writes_the_stored_state_and_the_next_step_judges_it():
    """A RETRIEVE of a chunk stored with a null end slot (merged objects)
    writes that garbage into the new request's slot; its first step after the
    load is the verdict: wrong state.  A correctly stored chunk passes."""
    truth = _prefilled(1)
    server = _server("merged")
    server.store("A", 0, 4 * N, [[10, NULL_BLOCK, 12, 13], [20, 21, 22, 23]], truth, digest)
    for end, ok in ((2 * N, False), (4 * N, True)):
        fresh = Truth(N, [MAMBA], [FA], num_spec=0)
        new_request(fresh, "Q", [NULL_BLOCK] * (end // N - 1) + [50, 51], [60, 61, 62, 63, 64])
        server.restore("Q", 0, end, [[NULL_BLOCK] * (end // N - 1) + [50], [60, 61, 62, 63][:end // N]],
                       fresh, digest)
        fresh.loaded.add("Q")
        fresh.apply([StepInput("Q", end, 1, [], 0)], digest, no_lists)
        assert fresh.restored == {"Q": ok}, end
        assert fresh.fa_digest(60, digest) == ("seq", N)  # FA came back intact
        assert not fresh.inconsistencies


def test_a_draft_made_state_counts_only_if_still_listed_at_the_next_schedule():
    """2 committed tokens, then [last, d1, d2] with both drafts accepted: the
    state after 4 tokens (a block boundary) exists only because d1 was
    accepted, so the connector learns of it at the next schedule()."""
    truth = Truth(N, [MAMBA], [FA], num_spec=2)
    new_request(truth, "A", [10, 11, 12], [20, 21])
    truth.apply([StepInput("A", 0, 2, [], 0)], digest, no_lists)
    truth.tables["A"][MAMBA].append(13)
    truth.apply([StepInput("A", 2, 3, [91, 92], 2)], digest, no_lists)
    assert truth.mamba[10] == ("seq", 4)  # postprocess copy into slot 0
    assert 4 not in truth.materialized.get("A", ()) and truth.pending
    assert not truth.inconsistencies
    truth.confirm_pending(lambda rid: [[NULL_BLOCK, 11, 12, 13], [20, 21]], digest)
    assert 4 not in truth.materialized.get("A", ())  # vLLM freed slot 0 in place: lost
    truth.pending.append(("A", MAMBA, 0, 10, 4))
    truth.confirm_pending(lambda rid: [[10, 11, 12, 13], [20, 21]], digest)
    assert 4 in truth.materialized["A"]
