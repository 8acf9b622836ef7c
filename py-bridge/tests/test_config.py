"""Configuration: kv_connector_extra_config keys and the VLLM_MOONCAKE_* variables, checked when
vLLM creates the connector — a bad setting stops the engine at start-up with a message naming it."""

import json

import pytest

import pdflow
from pdflow import _native
from vllm_harness import scheduler, vllm_config

ADVERTISE_URL = "http://10.0.0.1:8100"


def test_an_unknown_extra_config_key_is_refused_by_name():
    with pytest.raises(pdflow.ConfigError, match="hots"):
        scheduler(vllm_config("kv_producer", extra={"hots": "10.0.0.1"}))


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"transport": "infiniband"}, r'\["transport"\] = "infiniband"'),
        ({"tcp_streams": 0}, "tcp_streams"),
        ({"pull_timeout_s": -1}, "pull_timeout_s"),
        ({"host": "not-an-ip"}, "host"),
        ({"host": "10.0.0.1"}, "loopback peers only"),
        ({"insecure": "yes"}, r'\["insecure"\]: invalid type'),
        ({"bootstrap_url": "127.0.0.1:8998"}, "bootstrap_url"),
        ({"gpu_path": "nvlink"}, "gpu_path"),
        ({"cluster_secret_file": "/nonexistent/pdflow-secret"}, "/nonexistent/pdflow-secret"),
        ({"tls": True}, "needs the cluster secret"),
        ({"tls": "yes"}, r'\["tls"\]: invalid type'),
        ({"limits": {"http.header_timeout": 0}}, r'\["limits"\]: limit `http.header_timeout`'),
        ({"limits": {"side_channel.max_conections": 10}}, "unknown limit `side_channel.max_conections`"),
        ({"limits": {"side_channel.max_unfinished_bytes": "lots"}}, "number of bytes"),
        ({"advertise_url": "10.0.0.1:8100"}, r'\["advertise_url"\] = "10.0.0.1:8100": expected .*http://HOST:PORT'),
        ({"advertise_url": "http://10.0.0.1"}, r'\["advertise_url"\]'),
        ({"advertise_url": "http://10.0.0.1:8100/v1"}, r'\["advertise_url"\]'),
        ({"advertise_url": "http://0.0.0.0:8100"}, "not a wildcard"),
        ({"advertise_url": "https://10.0.0.1:8100"}, r'\["advertise_url"\]'),
        ({"advertise_url": 8100}, r'\["advertise_url"\]: invalid type'),
        ({"advertise_to": ["http://10.0.0.1:8998"]}, r'\["advertise_to"\]: needs advertise_url'),
        ({"advertise_url": ADVERTISE_URL, "advertise_to": "http://10.0.0.1:8998"}, r'\["advertise_to"\]: invalid type'),
        ({"advertise_url": ADVERTISE_URL, "advertise_to": ["10.0.0.1:8998"]}, r'\["advertise_to"\] = "10.0.0.1:8998"'),
    ],
)
def test_bad_values_are_refused_with_the_key(extra, needle):
    with pytest.raises(pdflow.ConfigError, match=needle):
        scheduler(vllm_config("kv_consumer", extra=extra))


def test_advertising_takes_an_engine_url_and_bootstrap_urls_and_each_role_what_it_can_use():
    # Either form of an engine URL; bootstraps as a list.
    for url in (ADVERTISE_URL, ADVERTISE_URL + "/", "http://engine-7.internal:8100", "http://[fd00::1]:8100"):
        _native.check_config(json.dumps({"advertise_url": url}))
    _native.check_config('{"advertise_url": "http://10.0.0.1:8100", "advertise_to": ["http://10.0.0.2:8998/"]}')
    ok = {"advertise_url": "http://127.0.0.1:8100", "advertise_to": ["http://127.0.0.1:8998"]}
    # P advertises at its own bootstrap; D needs somewhere to advertise; kv_both is neither pool.
    for role in ("kv_producer", "kv_consumer"):
        scheduler(vllm_config(role, extra=ok))
    scheduler(vllm_config("kv_producer", extra={"advertise_url": ok["advertise_url"]}))
    with pytest.raises(pdflow.ConfigError, match=r'\["advertise_to"\]: a kv_consumer \(D\) has no bootstrap'):
        scheduler(vllm_config("kv_consumer", extra={"advertise_url": ok["advertise_url"]}))
    with pytest.raises(pdflow.ConfigError, match=r'\["advertise_url"\]: a kv_both engine cannot be advertised'):
        scheduler(vllm_config("kv_both", extra=ok))
    with pytest.raises(pdflow.ConfigError, match="kv_both engine cannot be advertised"):
        _native.WorkerConnector("adv-both", "kv_both", json.dumps(ok))


def test_limits_take_numbers_and_sizes():
    _native.check_config('{"limits": {"http.header_timeout": 2.5, "side_channel.max_unfinished_bytes": "32MiB"}}')


def test_a_cluster_secret_too_short_to_be_one_is_refused_saying_how_long(tmp_path, monkeypatch):
    short = tmp_path / "secret"
    short.write_text("short\n")
    with pytest.raises(pdflow.ConfigError, match="at least 16"):
        scheduler(vllm_config("kv_consumer", extra={"cluster_secret_file": str(short)}))
    monkeypatch.setenv("PDFLOW_CLUSTER_SECRET", "tiny")
    with pytest.raises(pdflow.ConfigError, match="at least 16"):
        _native.check_config("{}")


def test_without_a_secret_a_host_off_loopback_needs_insecure(monkeypatch):
    # Protected mode: without a cluster secret pdflow serves loopback peers only, so a host no
    # peer could reach is refused at start-up, saying how to opt out.
    with pytest.raises(pdflow.ConfigError, match="insecure"):
        _native.check_config('{"host": "10.0.0.1"}')
    _native.check_config('{"host": "10.0.0.1", "insecure": true}')
    _native.check_config('{"host": "0.0.0.0"}')
    monkeypatch.setenv("PDFLOW_INSECURE", "1")
    _native.check_config('{"host": "10.0.0.1"}')
    monkeypatch.setenv("PDFLOW_INSECURE", "maybe")
    with pytest.raises(pdflow.ConfigError, match="PDFLOW_INSECURE"):
        _native.check_config("{}")


def test_vllm_mooncake_variables_keep_their_meaning(monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "soon")
    with pytest.raises(pdflow.ConfigError, match="VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"):
        _native.check_config("{}")
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480")
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "0")
    with pytest.raises(pdflow.ConfigError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT"):
        _native.check_config("{}")
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    _native.check_config('{"abort_request_timeout_s": 5, "tcp_streams": 2}')


def test_worker_registration_refuses_what_it_cannot_serve():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdflow.vllm import PdflowConnector
    from vllm_harness import kv_cache_config

    config = vllm_config("kv_consumer")
    worker = PdflowConnector(config, KVConnectorRole.WORKER, kv_cache_config(8))
    try:
        with pytest.raises(pdflow.RegistrationError, match="not contiguous"):
            worker.register_kv_caches({"l0": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16).transpose(1, 2)})
        with pytest.raises(pdflow.RegistrationError, match="differs"):
            worker.register_kv_caches({
                "l0": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16),
                "l1": torch.zeros(9, 8, 16, 256, dtype=torch.bfloat16),
            })
        with pytest.raises(pdflow.RegistrationError, match="one engine's KV lives on one device"):
            worker.register_kv_caches({
                "l0": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16),
                "l1": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16, device="meta"),
            })
        with pytest.raises(pdflow.RegistrationError, match="host memory or CUDA device memory"):
            worker.register_kv_caches({"l0": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16, device="meta")})
        if not _native.GPU_KV:
            # The wheel CI builds has no GPU support: a CUDA device index is refused by the native
            # half too, saying how to build one that has (no CUDA tensor is needed to ask).
            with pytest.raises(pdflow.RegistrationError, match="without GPU support"):
                worker._work().register_kv_caches([(1 << 20, 8 * 8 * 16 * 256 * 2)], (8, 8, 16, 128, 2), None, 0)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
        with pytest.raises(pdflow.ConfigError, match="not consecutive layers"):
            _native.WorkerTopology(pp_rank=0, pp_size=2, layer_names=[names[0], names[2]])
        assert _native.WorkerTopology(pp_rank=1, pp_size=2, layer_names=names[2:]).first_layer == 2
        with pytest.raises(pdflow.ConfigError, match="not a rank of the group"):
            _native.WorkerTopology(tp_rank=2, tp_size=2)
        # A pipeline stage whose layers are not its share of vLLM's default split (as with
        # VLLM_PP_LAYER_PARTITION): stage 1 of 2 over 4 layers holds layers 2 and 3, not 1 and 2.
        stage = torch.zeros(2, 8, 8, 16, 256, dtype=torch.bfloat16)
        regions = [(int(stage[i].data_ptr()), stage[i].numel() * 2) for i in range(2)]
        stage_1 = _native.WorkerTopology(pp_rank=1, pp_size=2, total_layers=4, layer_names=names[1:3])
        with pytest.raises(pdflow.RegistrationError, match="default split"):
            worker._work().register_kv_caches(regions, (8, 8, 16, 128, 2), stage, None, stage_1)
        # A tensor rank holding other than its share of the model's KV heads.
        with pytest.raises(pdflow.RegistrationError, match="shards the heads differently"):
            worker._work().register_kv_caches(
                regions, (8, 8, 16, 128, 2), stage, None, _native.WorkerTopology(tp_size=2, total_kv_heads=8)
            )
        with pytest.raises(pdflow.ConnectorUnavailable, match="register_kv_caches"):
            worker.get_transfer_results(set())
    finally:
        worker.shutdown()


def test_a_kv_both_worker_runs_both_halves():
    import socket

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdflow.vllm import PdflowConnector
    from vllm_harness import kv_cache_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = vllm_config("kv_both", extra={"bootstrap_port": port})
    worker = PdflowConnector(config, KVConnectorRole.WORKER, kv_cache_config(8))
    try:
        worker.register_kv_caches({f"l{i}": torch.zeros(8, 8, 16, 256, dtype=torch.bfloat16) for i in range(2)})
        info = worker._work().info()
        assert info["bootstrap_url"] == f"http://127.0.0.1:{port}", info
        assert info["data_addr"].startswith("127.0.0.1:"), info
        r = worker.get_transfer_results(set())
        assert not r.finished_sending and not r.finished_recving
    finally:
        worker.shutdown()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1rc1"])
def test_the_supported_vllm_versions_are_accepted(version):
    from pdflow import vllm_version

    assert vllm_version.check(version) in vllm_version.SUPPORTED


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "", "dev"])
def test_another_vllm_version_is_refused_naming_what_it_found(version):
    from pdflow import vllm_version

    with pytest.raises(pdflow.ConfigError, match=r"supports vLLM 0\.32 and 0\.33; this is vLLM " + repr(version)):
        vllm_version.check(version)


def test_the_installed_vllm_is_checked_when_the_connector_module_loads():
    import vllm

    import pdflow.vllm as connector

    assert connector.VLLM_VERSION == tuple(int(x) for x in vllm.__version__.split(".")[:2])


def _groups(*specs):
    """A KV-cache config of one group per spec, two layers each."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_a_hybrid_model_is_served_per_group_and_what_pdflow_cannot_move_is_refused_naming_the_group():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from pdflow.vllm import PdflowConnector

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=128)
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, attention_chunk_size=64
    )
    # Sliding window beside full attention, with vLLM's hybrid allocator on: each group its blocks.
    served = PdflowConnector(vllm_config("kv_consumer"), KVConnectorRole.SCHEDULER, _groups(full, window))
    assert served._kv_groups == [("full", 16, 0), ("sliding_window", 16, 128)]
    served.shutdown()
    # A kind of group pdflow does not move is named, with what serves the model instead.
    with pytest.raises(pdflow.ConfigError, match=r"KV-cache group 1 \(ChunkedLocalAttentionSpec, 2 layers\)") as e:
        PdflowConnector(vllm_config("kv_consumer"), KVConnectorRole.SCHEDULER, _groups(full, chunked))
    assert "--disable-hybrid-kv-cache-manager" in str(e.value)
    # Layer-wise transfer is for models of one group.
    layerwise = vllm_config("kv_producer", extra={"layerwise": True})
    with pytest.raises(pdflow.ConfigError, match=r"2 KV-cache groups \(full, sliding_window\(128\)\); layer-wise"):
        PdflowConnector(layerwise, KVConnectorRole.SCHEDULER, _groups(full, window))
