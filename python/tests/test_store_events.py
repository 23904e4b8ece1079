"""`--kv-events`: the KV store's events as vLLM KV events over ZeroMQ
(docs/KV_STORE.md section 7), read the way a cache-aware router reads
vLLM's: a SUB socket, multipart [topic, 8-byte big-endian sequence number,
msgpack KVEventBatch]. A subscriber rebuilds the set of pages per medium
from two `kvcache bench-serve` runs sharing one directory tier (the second
restores the first's pages, a small byte budget makes the tier evict), and
the dir tier's set must be exactly the .kvp files left in the directory.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cli_path import kvcache_cli

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"



def _model() -> Path:
    m = Path(os.environ.get("KVCACHE_MODEL", DEFAULT_MODEL))
    if not m.exists():
        pytest.skip(f"{m} is missing (scripts/fetch_model.sh)")
    return m


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], endpoint: str) -> list[list[bytes]]:
    """Runs bench-serve publishing to endpoint; returns every message a SUB
    connected before the bind received (the publisher waits 200 ms after
    binding before its first send: the slow-joiner grace)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 10)  # retry fast until the process binds
    sub.connect(endpoint)
    proc = subprocess.Popen([str(kvcache_cli()), "bench-serve", *args, "--kv-events", endpoint],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    msgs = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if sub.poll(100):
                msgs.append(sub.recv_multipart())
            elif proc.poll() is not None:
                while sub.poll(500):  # close waited for delivery; take the rest
                    msgs.append(sub.recv_multipart())
                break
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 0, err
        assert "dropped" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        sub.close(linger=0)
        ctx.term()
    return msgs


def _decode(msgs: list[list[bytes]]) -> list[dict]:
    """The events of msgs in order, after checking the framing and batch."""
    events = []
    for i, frames in enumerate(msgs):
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b""
        assert len(seq) == 8 and int.from_bytes(seq, "big") == i  # none lost, in order
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 3  # [ts, events, data_parallel_rank]
        ts, evs, dp_rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600
        assert dp_rank == 0
        assert 1 <= len(evs) <= 64
        events.extend(evs)
    return events


def test_subscriber_rebuilds_the_dir_tier(tmp_path):
    model = _model()
    rng = random.Random(20261122)
    prompt_len = rng.choice([192, 256, 320])  # whole pages of 16
    b1 = rng.choice([3, 4])
    b2 = b1 + rng.choice([1, 2])  # the first b1 prompts again (restored), then new ones
    store = tmp_path / "tier"
    # a budget of about 40 pages: the second run makes the tier evict
    common = ["-m", str(model), "--prompt-len", str(prompt_len), "--gen", "4", "--kv-dtype",
              "f16", "-t", "2", "--kv-store", f"dir:{store}?max_bytes=15M"]
    streams = [_serve(common + ["--batch", str(b)], f"tcp://127.0.0.1:{_free_port()}")
               for b in (b1, b2)]

    sets: dict[str, set[bytes]] = {}
    ever_stored: set[bytes] = set()
    removed_disk = 0
    for msgs in streams:
        assert msgs, "no event reached the subscriber"
        gpu_seen = 0
        for ev in _decode(msgs):
            kind, medium = ev["type"], ev.get("medium")
            assert medium in ("GPU", "DISK")
            s = sets.setdefault(medium, set())
            if kind == "BlockStored":
                hashes = ev["block_hashes"]
                assert hashes and all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
                assert ev["block_size"] == 16  # the engine's page size
                assert len(ev["token_ids"]) == ev["block_size"] * len(hashes)
                assert ev["lora_id"] is None and ev["lora_name"] is None
                parent = ev["parent_block_hash"]
                # None: the first page of a prompt (its parent is the namespace)
                assert parent is None or parent in ever_stored
                if medium == "DISK":
                    # a page is written once final in the engine's cache
                    assert all(h in ever_stored for h in hashes)
                ever_stored.update(hashes)
                s.update(hashes)
                gpu_seen += medium == "GPU"
            elif kind == "BlockRemoved":
                assert all(isinstance(h, bytes) and len(h) == 16 for h in ev["block_hashes"])
                removed_disk += medium == "DISK"
                s.difference_update(ev["block_hashes"])
            else:
                assert kind == "AllBlocksCleared"
                s.clear()
        # the process detached its engine: every GPU page it reported, removed
        assert gpu_seen and not sets.get("GPU")
    assert removed_disk > 0, "the budget should have evicted"

    files = {p for p in store.rglob("*.kvp") if "tmp" not in p.relative_to(store).parts}
    ns_dirs = {p.relative_to(store).parts[0] for p in files}
    assert len(ns_dirs) == 1  # one model, one salt: one namespace
    on_disk = {bytes.fromhex(p.stem) for p in files}
    assert on_disk == sets["DISK"]
    for p in files:  # PATH/<ns>/<2 hex>/<key>.kvp
        assert p.parent.name == p.stem[:2]


def test_kv_events_without_a_store(tmp_path):
    """--kv-events alone publishes the engine cache's pages: the same GPU
    events as beside a directory tier (same prompts, same keys)."""
    model = _model()
    common = ["-m", str(model), "--batch", "2", "--prompt-len", "64", "--gen", "4",
              "--kv-dtype", "f16", "-t", "2"]

    def gpu_events(extra):
        evs = _decode(_serve(common + extra, f"tcp://127.0.0.1:{_free_port()}"))
        assert evs and all(ev.get("medium") in ("GPU", "DISK") for ev in evs)
        return [ev for ev in evs if ev["medium"] == "GPU"]

    def blocks(evs):
        """Per block, in order: (type, hash, parent, ids); how blocks group
        into events depends on when batches are cut."""
        out = []
        for ev in evs:
            parent = ev.get("parent_block_hash")
            for i, h in enumerate(ev.get("block_hashes", [])):
                n = ev.get("block_size", 0)
                ids = tuple(ev["token_ids"][i * n:(i + 1) * n]) if n else ()
                out.append((ev["type"], h, parent, ids))
                if ev["type"] == "BlockStored":
                    parent = h
        return out

    alone = gpu_events([])
    beside = gpu_events(["--kv-store", f"dir:{tmp_path / 'tier'}"])
    assert all(ev["medium"] == "GPU" for ev in alone)
    stored = [b for b in blocks(alone) if b[0] == "BlockStored"]
    assert len(stored) >= 2 * 64 // 16  # each prompt's pages, at least
    assert blocks(alone) == blocks(beside)


def test_bench_serve_cases_share_one_stream():
    """bench-serve with several cases: one publisher for all (sequence
    numbers run on, which _decode checks), and each case's engine, detached
    at its end, leaves no GPU page behind before the next case's."""
    model = _model()
    args = ["-m", str(model), "--batch", "1,2", "--prompt-len", "160", "--gen", "2",
            "--kv-dtype", "f16,kivi8", "-t", "2"]
    evs = _decode(_serve(args, f"tcp://127.0.0.1:{_free_port()}"))
    live: set[bytes] = set()
    drained = 0  # times the set of GPU pages went back to empty
    for ev in evs:
        assert ev["medium"] == "GPU" and ev["type"] in ("BlockStored", "BlockRemoved")
        if ev["type"] == "BlockStored":
            live.update(ev["block_hashes"])
        else:
            assert set(ev["block_hashes"]) <= live
            live.difference_update(ev["block_hashes"])
            drained += not live
    assert not live
    assert drained == 4  # 2 batch sizes x 2 formats: four engines in turn


def test_replay_returns_what_the_subscriber_saw(tmp_path):
    """--kv-events-replay: vLLM's replay protocol against a live `kvcache
    chat` (it waits on stdin): a REQ-style DEALER asks for the batches from
    number 1 and gets them byte for byte as published, then END_SEQ (-1)
    with an empty payload."""
    model = _model()
    endpoint = f"ipc://{tmp_path}/ev.sock"
    replay_ep = f"ipc://{tmp_path}/replay.sock"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RECONNECT_IVL, 10)
    sub.connect(endpoint)
    proc = subprocess.Popen([str(kvcache_cli()), "chat", "-m", str(model), "-n", "24", "-t", "2",
                             "--kv-events", endpoint, "--kv-events-replay", replay_ep],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("Name three colours of the rainbow, one per line.\n")
        proc.stdin.flush()
        proc.stdout.readline()  # the reply is out: its pages' events are queued
        published = {}
        while sub.poll(2000):
            _, seq, payload = sub.recv_multipart()
            published[int.from_bytes(seq, "big")] = payload
        assert len(published) >= 2 and sorted(published) == list(range(len(published)))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10000)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = {}
        while True:
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed[int.from_bytes(seq, "big")] = payload
        # every batch from 1 on, in order; any sent after the SUB stopped
        # listening come last
        assert sorted(replayed) == list(range(1, 1 + len(replayed)))
        assert all(replayed[s] == p for s, p in published.items() if s >= 1)
        dealer.close(linger=0)
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        sub.close(linger=0)
        ctx.term()
