#!/usr/bin/env python3
"""Mooncake's TransferEngine over protocol "tcp", moving the seed request between two processes.

The comparison point of `pdflow bench transfer --compare-mooncake`. This is pdflow's own
script: it installs `mooncake-transfer-engine-non-cuda` (pip) and `libibverbs1` (apt-get) when
missing, starts a target process (D) that registers a buffer, and writes into it from this process
(P) with Mooncake's engine:

- coalesced:   36 descriptors of 4,128,768 B (the seed's plan, one per layer)  = 148,635,648 B
- uncoalesced: 2,268 descriptors of 65,536 B (one per block and layer)          = 148,635,648 B
- a 32 KiB write (one descriptor)

With default settings Mooncake's tcp transport rejects the 2,268-descriptor batch ("queue-full");
the script then measures it again in a fresh pair of processes with the per-peer queue raised
(MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER), reported as its own row.

Each is timed over --runs runs after --warmup; D's bytes are checked once per mode. Rows are
printed as JSON in pdflow's bench shape: {"rows": [{"name", "backend", "plan", "concurrency",
"bytes", "median_ms", "min_ms", "max_ms", "gbps", "note"}]}. A mode Mooncake rejects becomes a row
with null figures and a note; the script still exits 0 unless Mooncake cannot run at all (then it
prints one row with the reason and exits 2).
"""

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import time

LAYERS = 36
BLOCKS = 63
BLOCK_LEN = 65536
RUN_LEN = BLOCKS * BLOCK_LEN  # 4,128,768 B: one layer's 63 blocks
STRIDE = RUN_LEN + (1 << 20)  # regions apart, so nothing can merge neighbouring descriptors
TOTAL = LAYERS * RUN_LEN  # 148,635,648 B
SMALL = 32 * 1024
BACKEND = "mooncake-tcp"


def ensure_installed():
    """Installs what Mooncake's wheel needs, when missing. Returns None or the reason it cannot."""
    try:
        import mooncake.engine  # noqa: F401
        return None
    except ImportError as e:
        first = str(e)
    if "libibverbs" in first or "ibverbs" in first:
        pass
    elif "No module named" in first:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mooncake-transfer-engine-non-cuda"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return "pip install mooncake-transfer-engine-non-cuda failed: " + r.stderr.strip()[-400:]
    try:
        import mooncake.engine  # noqa: F401
        return None
    except ImportError as e:
        if "ibverbs" not in str(e):
            return f"cannot import mooncake.engine: {e}"
    if shutil.which("apt-get") is None:
        return "libibverbs1 is missing and apt-get is not available"
    r = subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
        r = subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], capture_output=True, text=True)
        if r.returncode != 0:
            return "apt-get install libibverbs1 failed: " + r.stderr.strip()[-400:]
    try:
        import mooncake.engine  # noqa: F401
        return None
    except ImportError as e:
        return f"cannot import mooncake.engine after installing libibverbs1: {e}"


def new_engine():
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def buffer(size):
    """An anonymous mapping and its address (kept alive by the caller)."""
    mm = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, addr


def digest(addr, ranges):
    h = hashlib.blake2b(digest_size=16)
    for off, length in ranges:
        h.update(ctypes.string_at(addr + off, length))
    return h.hexdigest()


def region_ranges():
    return [(layer * STRIDE, RUN_LEN) for layer in range(LAYERS)]


def target():
    """D: registers a buffer, prints its address and rpc port, then answers commands on stdin."""
    engine = new_engine()
    size = LAYERS * STRIDE
    mm, addr = buffer(size)
    if engine.register_memory(addr, size) != 0:
        raise RuntimeError("register_memory failed on the target")
    print(json.dumps({"rpc_port": engine.get_rpc_port(), "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "zero":
            mm.seek(0)
            mm.write(bytes(size))
            print("ok", flush=True)
        elif cmd == "digest":
            print(digest(addr, region_ranges()), flush=True)
        elif cmd == "digest-small":
            print(digest(addr, [(0, SMALL)]), flush=True)
        elif cmd == "quit":
            break
    del engine


def summarize(samples):
    s = sorted(samples)
    n = len(s)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return median, s[0], s[-1]


def row(name, plan, nbytes, samples, note=None):
    r = {"name": name, "backend": BACKEND, "plan": plan, "concurrency": 1, "bytes": nbytes,
         "median_ms": None, "min_ms": None, "max_ms": None, "gbps": None}
    if samples:
        median, lo, hi = summarize(samples)
        r.update(median_ms=median, min_ms=lo, max_ms=hi, gbps=nbytes / (median / 1e3) / 1e9 if median > 0 else None)
    if note:
        r["note"] = note
    return r


def initiator(args):
    child = subprocess.Popen([sys.executable, __file__, "--role", "target"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def ask(cmd):
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    rows = []
    try:
        hello = json.loads(child.stdout.readline())
        peer = f"127.0.0.1:{hello['rpc_port']}"
        remote = hello["addr"]
        engine = new_engine()
        size = LAYERS * STRIDE
        mm, local = buffer(size)
        pattern = bytes(range(251)) * (size // 251 + 1)
        mm.seek(0)
        mm.write(pattern[:size])
        if engine.register_memory(local, size) != 0:
            raise RuntimeError("register_memory failed on the initiator")
        want = digest(local, region_ranges())

        coalesced = [(local + o, remote + o, n) for o, n in region_ranges()]
        uncoalesced = [(local + o + b * BLOCK_LEN, remote + o + b * BLOCK_LEN, BLOCK_LEN)
                       for o, _ in region_ranges() for b in range(BLOCKS)]
        small = [(local, remote, SMALL)]
        modes = [m for m in [("mooncake seed coalesced (36 desc)", "coalesced", coalesced, TOTAL, "digest", args.runs),
                 ("mooncake 32 KiB write", "single", small, SMALL, "digest-small", args.small_runs),
                 # Last: a rejected batch can leave Mooncake's lane unusable for later writes.
                 ("mooncake seed uncoalesced (2,268 desc)", "uncoalesced", uncoalesced, TOTAL, "digest", args.runs)]
                 if m[1] in args.modes]
        for name, plan, descs, nbytes, check, runs in modes:
            srcs, dsts, lens = [d[0] for d in descs], [d[1] for d in descs], [d[2] for d in descs]
            ask("zero")
            samples, note = [], None
            for i in range(args.warmup + runs):
                started = time.perf_counter()
                rc = engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
                took = (time.perf_counter() - started) * 1e3
                if rc != 0:
                    note = f"batch_transfer_sync_write returned {rc} with {len(descs)} descriptors"
                    samples = []
                    break
                if i == 0:
                    got = ask(check)
                    expected = want if check == "digest" else digest(local, [(0, SMALL)])
                    if got != expected:
                        note = "D's bytes differ from P's after the write"
                        samples = []
                        break
                if i >= args.warmup:
                    samples.append(took)
            rows.append(row(name, plan, nbytes, samples, note))
    finally:
        try:
            ask("quit")
        except Exception:
            pass
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    return rows


def raised_queue_rows(args, rows):
    """Re-measures the uncoalesced plan with the per-peer queue raised, if the default rejected it."""
    rejected = [r for r in rows if r["plan"] == "uncoalesced" and r["median_ms"] is None]
    if not rejected:
        return []
    cmd = [sys.executable, __file__, "--modes", "uncoalesced", "--queue", "8192", "--runs", str(args.runs),
           "--warmup", str(args.warmup)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        extra = json.loads(r.stdout)["rows"]
    except (ValueError, KeyError):
        return [row("mooncake seed uncoalesced (queue raised)", "uncoalesced", TOTAL, [],
                    "rerun with MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=8192 failed: " + r.stderr.strip()[-300:])]
    for e in extra:
        e["name"] = "mooncake seed uncoalesced (queue 8192)"
    return extra


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--small-runs", type=int, default=200)
    ap.add_argument("--json", help="write the rows here (default: stdout)")
    ap.add_argument("--modes", default="coalesced,uncoalesced,single", help="comma-separated plans to run")
    ap.add_argument("--queue", type=int, help="set MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (both processes)")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    if args.queue:
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(args.queue)
    if args.role == "target":
        target()
        return 0
    reason = ensure_installed()
    if reason is None:
        try:
            rows = initiator(args)
            if not args.queue:
                rows += raised_queue_rows(args, rows)
        except Exception as e:  # any failure is reported as a row, never a traceback only
            reason = f"mooncake run failed: {e}"
    status = 0
    if reason is not None:
        rows = [row("mooncake (unavailable)", None, None, [], reason)]
        status = 2
    out = json.dumps({"rows": rows}, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(out)
    else:
        print(out)
    return status


if __name__ == "__main__":
    sys.exit(main())
