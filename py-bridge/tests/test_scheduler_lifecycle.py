"""vLLM 0.33's real v1 Scheduler with PdflowConnector, through the seed's P and D lifecycles.

Every test ends with the scheduler's free-block count back at its baseline: no leaked KV blocks.
The worker's output (`finished_sending`, `finished_recving`, failures) is played by the test, as
the model runner would report it; the data path itself is `test_data_path.py`.
"""

import pickle

import pytest

from vllm_harness import (
    EOS,
    SEED_PROMPT,
    RequestStatus,
    Runner,
    d_params,
    free_blocks,
    kv_output,
    p_params,
    prompt_tokens,
    request,
    scheduler,
    vllm_config,
)

SEED_BLOCKS = 63  # ceil(1000 / 16)


def producer(**kw):
    s = scheduler(vllm_config("kv_producer", **kw))
    return s, free_blocks(s)


def consumer(**kw):
    s = scheduler(vllm_config("kv_consumer", **kw))
    return s, free_blocks(s)


def test_prefill_keeps_its_blocks_until_finished_sending():
    s, baseline = producer()
    r = request(p_params("xfer-seed"))
    s.add_request(r)
    run = Runner(s)
    _, meta = run.step()
    # Step 13: the pending send, with no blocks yet; the request finished after one token (step 23).
    assert meta.reqs_to_send == {r.request_id: ("xfer-seed", [])}
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # P's answer names what D needs (a proxy that forwards P's answer to D relies on it).
    for_d = run.finished[r.request_id].kv_transfer_params
    assert for_d["do_remote_prefill"] and not for_d["do_remote_decode"], for_d
    assert for_d["transfer_id"] == "xfer-seed" and for_d["remote_bootstrap_addr"] == "http://127.0.0.1:8998", for_d
    assert for_d["remote_engine_id"] == s.connector.engine_id, for_d
    held = baseline - free_blocks(s)
    assert held == SEED_BLOCKS, "delayed free: the prompt's blocks stay allocated"
    # Step 26: the blocks go to the worker, once.
    _, meta = run.step()
    transfer_id, blocks = meta.reqs_to_send[r.request_id]
    assert transfer_id == "xfer-seed" and len(blocks) == SEED_BLOCKS
    for _ in range(3):
        _, meta = run.step()
        assert not meta.reqs_to_send, "a send is announced once"
    assert baseline - free_blocks(s) == SEED_BLOCKS, "still held until the worker says sent"
    # Steps 32-33: finished_sending frees them.
    run.step(kv_output(sending=[r.request_id]))
    assert free_blocks(s) == baseline


def test_prefill_whose_first_token_is_eos_still_sends_its_kv():
    s, baseline = producer()
    r = request(p_params("xfer-eos"))
    s.add_request(r)
    run = Runner(s, token=lambda req: EOS)
    run.step()
    assert r.status == RequestStatus.FINISHED_STOPPED
    _, meta = run.step()
    assert len(meta.reqs_to_send[r.request_id][1]) == SEED_BLOCKS, "the prompt's KV is valid: D must get it"
    run.step(kv_output(sending=[r.request_id]))
    assert free_blocks(s) == baseline


def test_prefill_aborted_frees_at_once_and_tells_the_worker():
    s, baseline = producer(max_num_batched_tokens=256)
    r = request(p_params("xfer-abort"))
    s.add_request(r)
    run = Runner(s)
    run.step()  # first chunk of four
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    _, meta = run.step()
    assert "xfer-abort" in meta.reqs_not_processed, "the worker must refuse D's pull for it"
    assert not meta.reqs_to_send.get(r.request_id, ("", []))[1]
    assert free_blocks(s) == baseline


def test_chunked_prefill_announces_the_send_once_and_sends_every_block():
    s, baseline = producer(max_num_batched_tokens=256)
    r = request(p_params("xfer-chunked"))
    s.add_request(r)
    run = Runner(s)
    announced = []
    for _ in range(4):
        out, meta = run.step()
        assert out.num_scheduled_tokens.get(r.request_id, 0) <= 256
        announced += [v for k, v in meta.reqs_to_send.items() if k == r.request_id]
    assert announced == [("xfer-chunked", [])]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    _, meta = run.step()
    assert len(meta.reqs_to_send[r.request_id][1]) == SEED_BLOCKS
    run.step(kv_output(sending=[r.request_id]))
    assert free_blocks(s) == baseline


def test_layer_wise_chunked_prefill_names_every_chunk_with_its_blocks_in_reqs_to_save():
    s, baseline = producer(max_num_batched_tokens=256, extra={"layerwise": True})
    r = request(p_params("xfer-layerwise"))
    s.add_request(r)
    run = Runner(s)
    saves = []
    for _ in range(4):
        _, meta = run.step()
        saves.append(meta.reqs_to_save[r.request_id])
    assert [x["computed_upto"] for x in saves] == [256, 512, 768, SEED_PROMPT]
    assert all(x["transfer_id"] == "xfer-layerwise" and x["prompt_len"] == SEED_PROMPT for x in saves)
    # Each chunk's blocks cover what is computed so far; the last, the whole prompt's.
    assert [len(x["block_ids"]) for x in saves] == [16, 32, 48, SEED_BLOCKS]
    assert saves[-1]["block_ids"][:16] == saves[0]["block_ids"]
    _, meta = run.step()
    assert not meta.reqs_to_save, "a finished prefill streams no more"
    assert len(meta.reqs_to_send[r.request_id][1]) == SEED_BLOCKS
    run.step(kv_output(sending=[r.request_id]))
    assert free_blocks(s) == baseline


def test_decode_waits_for_remote_kv_then_computes_one_token_and_decodes_128():
    s, baseline = consumer()
    params = d_params("xfer-seed")
    r = request(params, max_tokens=128)
    assert r.kv_transfer_params is params, "vLLM keeps the proxy's dict: the connector edits it in place"
    s.add_request(r)
    run = Runner(s)
    out, meta = run.step()
    # Steps 17-18: all 63 blocks allocated, one pull, the request parked.
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.num_scheduled_tokens
    pull = meta.reqs_to_recv["p-engine"][r.request_id]
    assert pull["transfer_id"] == "xfer-seed" and len(pull["local_block_ids"]) == SEED_BLOCKS
    assert pull["remote_bootstrap_addr"] == "http://127.0.0.1:8998"
    assert params["do_remote_prefill"] is False, "one pull per request"
    assert baseline - free_blocks(s) == SEED_BLOCKS
    for _ in range(3):
        out, meta = run.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
        assert not meta.reqs_to_recv
    # Steps 35-37: the KV arrived; the next schedule computes only the last prompt token.
    run.step(kv_output(recving=[r.request_id]))
    out, meta = run.step()
    assert out.num_scheduled_tokens == {r.request_id: 1}, "computed = prompt - 1"
    assert not meta.reqs_to_recv, "the second update_state_after_alloc does not pull again"
    steps = 1
    while r.request_id not in run.finished:
        out, meta = run.step()
        assert not meta.reqs_to_recv
        steps += 1
        assert steps < 200
    assert len(r.output_token_ids) == 128
    assert run.finished[r.request_id].finish_reason is not None
    assert free_blocks(s) == baseline


def while_p_prefills(transfer_id: str) -> dict:
    """D's parameters as pdflow's proxy writes them: sent while P still prefills."""
    return {**d_params(transfer_id), "prefill_in_flight": True}


def two_sharing_a_prefix(s, params):
    """Two D requests on one 640-token prefix (40 blocks of 16), added together."""
    shared = prompt_tokens(640, 1)
    first = request(params("xfer-first"), max_tokens=2, prompt_token_ids=shared + prompt_tokens(360, 2))
    second = request(params("xfer-second"), max_tokens=2, prompt_token_ids=shared + prompt_tokens(360, 3))
    s.add_request(first)
    s.add_request(second)
    return first, second, Runner(s)


def run_until_finished(run, n: int) -> None:
    for _ in range(50):
        if len(run.finished) >= n:
            return
        run.step()
    raise AssertionError(f"{len(run.finished)} of {n} requests finished in 50 steps")


def test_decode_sharing_a_prefix_in_flight_waits_for_it_then_loads_only_the_rest():
    # Two D requests on one 640-token prefix (40 blocks) arrive together: the second pulls only
    # its own 23 blocks, after the first's KV landed in D's prefix cache.
    s, baseline = consumer()
    first, second, run = two_sharing_a_prefix(s, while_p_prefills)
    out, meta = run.step()
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(meta.reqs_to_recv["p-engine"][first.request_id]["local_block_ids"]) == SEED_BLOCKS
    assert second.status == RequestStatus.WAITING, "its first block is in flight for the first request"
    assert second.request_id not in meta.reqs_to_recv.get("p-engine", {})
    for _ in range(3):
        out, meta = run.step()
        assert second.status == RequestStatus.WAITING and not meta.reqs_to_recv
    run.step(kv_output(recving=[first.request_id]))
    pulls = {}
    for _ in range(3):
        out, meta = run.step()
        pulls.update(meta.reqs_to_recv.get("p-engine", {}))
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(pulls[second.request_id]["local_block_ids"]) == SEED_BLOCKS - 40, "the shared 40 blocks are D's own now"
    run.step(kv_output(recving=[second.request_id]))
    run_until_finished(run, 2)
    s.reset_prefix_cache()
    assert free_blocks(s) == baseline


def test_decode_whose_shared_prefix_load_failed_loads_it_itself():
    # The first load fails: nothing was cached, so the second request pulls its whole prompt.
    s, baseline = consumer()
    first, second, run = two_sharing_a_prefix(s, while_p_prefills)
    run.step()
    assert second.status == RequestStatus.WAITING
    run.step(kv_output(recving=[first.request_id], failed=[first.request_id]))
    assert first.status == RequestStatus.FINISHED_ERROR
    pulls = {}
    for _ in range(3):
        out, meta = run.step()
        pulls.update(meta.reqs_to_recv.get("p-engine", {}))
    assert len(pulls[second.request_id]["local_block_ids"]) == SEED_BLOCKS
    run.step(kv_output(recving=[second.request_id]))
    run_until_finished(run, 2)
    run.step()
    s.reset_prefix_cache()
    assert free_blocks(s) == baseline


@pytest.mark.parametrize("case", ["asked after P answered", "no prefix caching"])
def test_decode_never_waits_where_a_wait_cannot_pay(case):
    # A proxy that calls D once P answered (vLLM's router, its toy proxy): P's KV is ready, and a
    # wait would add to the time to first token. Without prefix caching the first load caches
    # nothing the second could use. Both requests pull at once.
    if case == "asked after P answered":
        s, baseline = consumer()
        first, second, run = two_sharing_a_prefix(s, d_params)
    else:
        s, baseline = consumer(prefix_caching=False)
        first, second, run = two_sharing_a_prefix(s, while_p_prefills)
    out, meta = run.step()
    pulls = meta.reqs_to_recv["p-engine"]
    assert len(pulls[first.request_id]["local_block_ids"]) == SEED_BLOCKS
    assert len(pulls[second.request_id]["local_block_ids"]) == SEED_BLOCKS
    run.step(kv_output(recving=[first.request_id, second.request_id]))
    run_until_finished(run, 2)
    s.reset_prefix_cache()
    assert free_blocks(s) == baseline


def test_decode_aborted_while_its_kv_is_in_flight_cancels_the_pull_and_frees_after_settling():
    s, baseline = consumer()
    r = request(d_params("xfer-inflight"), max_tokens=16)
    s.add_request(r)
    run = Runner(s)
    run.step()
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    _, meta = run.step()
    assert r.request_id in meta.reqs_to_abort, "the worker cancels the pull at once"
    assert baseline - free_blocks(s) == SEED_BLOCKS, "no write-after-free: blocks kept until the pull settles"
    # The worker reports the cancelled pull as failed (finished_recving too, as vLLM requires).
    run.step(kv_output(recving=[r.request_id], failed=[r.request_id]))
    run.step()
    assert free_blocks(s) == baseline


def test_decode_aborted_before_it_was_scheduled_still_tells_p_to_free():
    s, baseline = consumer(max_num_batched_tokens=64)
    blocker = request(None, prompt_len=3000, max_tokens=1)
    s.add_request(blocker)
    r = request(d_params("xfer-early"), max_tokens=16)
    s.add_request(r)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    run = Runner(s)
    _, meta = run.step()
    pull = meta.reqs_to_recv["p-engine"][r.request_id]
    assert pull["local_block_ids"] == [] and pull["transfer_id"] == "xfer-early"
    s.finish_requests(blocker.request_id, RequestStatus.FINISHED_ABORTED)
    run.step()
    assert free_blocks(s) == baseline


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_whose_kv_load_failed_follows_kv_load_failure_policy(policy):
    s, baseline = consumer(policy=policy)
    r = request(d_params("xfer-lost"), max_tokens=4)
    s.add_request(r)
    run = Runner(s)
    run.step()
    run.step(kv_output(recving=[r.request_id], failed=[r.request_id]))
    if policy == "fail":
        assert r.status == RequestStatus.FINISHED_ERROR
        assert run.finished[r.request_id].finish_reason is not None
    else:
        out, _ = run.step()
        assert out.num_scheduled_tokens[r.request_id] == SEED_PROMPT, "recompute prefills the whole prompt locally"
        while r.request_id not in run.finished:
            run.step()
        assert len(r.output_token_ids) == 4
    run.step()
    assert free_blocks(s) == baseline


def test_concurrent_requests_on_both_sides_all_end_and_free():
    p, p_base = producer(max_num_batched_tokens=2048)
    d, d_base = consumer(max_num_batched_tokens=2048)
    p_reqs = [request(p_params(f"xfer-c{i}"), prompt_len=200 + 37 * i) for i in range(8)]
    d_reqs = [request(d_params(f"xfer-c{i}"), prompt_len=200 + 37 * i, max_tokens=8) for i in range(8)]
    prompt_lens = {r.request_id: r.num_prompt_tokens for r in p_reqs}
    for r in p_reqs:
        p.add_request(r)
    for r in d_reqs:
        d.add_request(r)
    prun, drun = Runner(p), Runner(d)
    to_send, pulls = {}, {}
    for _ in range(30):
        _, pmeta = prun.step(kv_output(sending=list(to_send)))
        to_send = {k: v for k, v in pmeta.reqs_to_send.items() if v[1]}
        for k, v in to_send.items():
            assert len(v[1]) == -(-prompt_lens[k] // 16), "every prompt block is sent"
        _, dmeta = drun.step(kv_output(recving=list(pulls)))
        pulls = {k: v for m in dmeta.reqs_to_recv.values() for k, v in m.items()}
        if len(drun.finished) == 8 and len(prun.finished) == 8 and not to_send and not pulls:
            break
    assert set(prun.finished) == {r.request_id for r in p_reqs}
    assert set(drun.finished) == {r.request_id for r in d_reqs}
    assert all(len(r.output_token_ids) == 8 for r in d_reqs)
    prun.step()
    assert free_blocks(p) == p_base and free_blocks(d) == d_base


def test_metadata_crosses_to_the_workers_by_pickle_and_reads_like_mooncakes():
    s, _ = consumer()
    r = request(d_params("xfer-pickle"))
    s.add_request(r)
    _, meta = Runner(s).step()
    copy = pickle.loads(pickle.dumps(meta))
    assert type(copy).__name__ == "PdflowConnectorMetadata"
    assert copy.frame == meta.frame and copy.reqs_to_recv == meta.reqs_to_recv
    assert copy.reqs_to_send == {} and copy.reqs_not_processed == set()


def test_a_request_with_broken_params_is_served_locally():
    s, baseline = consumer()
    r = request({"do_remote_prefill": True, "transfer_id": "xfer-broken"}, max_tokens=2, prompt_len=40)
    s.add_request(r)
    run = Runner(s)
    out, meta = run.step()
    assert out.num_scheduled_tokens.get(r.request_id) == 40, "no remote_engine_id: prefilled here"
    assert not meta.reqs_to_recv
    while r.request_id not in run.finished:
        run.step()
    assert free_blocks(s) == baseline
    reason = s.connector._sched().on_new_request(r.request_id, 40, {"do_remote_prefill": True, "transfer_id": "x"})
    assert reason is not None and "lacks" in reason and "do_remote_prefill" in reason
