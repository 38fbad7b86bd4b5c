"""Crafted GGUF files: every hostile header is a clear ImportFailedError, fast, never a crash.

The files are built byte by byte (struct.pack) the way an attacker would write
them. mlx's native reader trusts these fields: with mlx 0.32, 20 dimensions
abort the process (an assert in gguflib) and the deprecated type 4 divides by
zero (SIGFPE), so the full import of every crafted file runs in a subprocess
whose exit status is checked too.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from omlx.errors import ImportFailedError
from omlx.memory.probe import MemoryProbe
from omlx.models.gguf import build_config
from omlx.models.gguf_reader import GGUFHeader, read_header
from omlx.models.gguf_tokenizer import build_tokenizer
from omlx.models.import_child import run_in_child
from tests.unit.import_child_targets import allocate, die, hold_memory, refuse

ROOT = Path(__file__).resolve().parents[2]
U8, U32, U64, STRING, ARRAY = 0, 4, 10, 8, 9
F32, Q4_0 = 0, 2


# ---------------------------------------------------------------- byte builder


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", kind) + payload


def tensor_info(name: str, dims: list[int], kind: int = F32, offset: int = 0, n_dims=None) -> bytes:
    count = len(dims) if n_dims is None else n_dims
    packed_dims = b"".join(struct.pack("<Q", d) for d in dims)
    return gstr(name) + struct.pack("<I", count) + packed_dims + struct.pack("<IQ", kind, offset)


ARCH = kv("general.architecture", STRING, gstr("llama"))
GOOD_TENSOR = tensor_info("a.weight", [8, 2])  # 16 float32 = 64 bytes at offset 0


def gguf_bytes(
    kvs: list[bytes] = (ARCH,),
    tensors: list[bytes] = (GOOD_TENSOR,),
    data: bytes = b"\0" * 64,
    *,
    alignment: int = 32,
    num_tensors: int | None = None,
    num_kvs: int | None = None,
) -> bytes:
    n_t = len(tensors) if num_tensors is None else num_tensors
    n_kv = len(kvs) if num_kvs is None else num_kvs
    head = b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % alignment) + data


def nested_array(depth: int) -> bytes:
    inner = struct.pack("<IQ", U8, 1) + b"\x01"
    for _ in range(depth):
        inner = struct.pack("<IQ", ARRAY, 1) + inner
    return inner


# (id, file bytes, what the error must say)
CRAFTED: list[tuple[str, bytes, str]] = [
    # 2^32 x 2^32 float32: an int64 product wraps to 0 and passed the old size check.
    ("dims-wrap-int64", gguf_bytes(tensors=[tensor_info("a.weight", [2**32, 2**32])]),
     r"tensor 'a\.weight' dimension 0 is 4294967296: larger than the file"),
    ("dims-product-past-file", gguf_bytes(tensors=[tensor_info("a.weight", [16, 16])]),
     r"tensor 'a\.weight' \(F32, shape \[16, 16\]\) needs 1024 bytes: larger than the file"),
    ("dims-2^63", gguf_bytes(tensors=[tensor_info("a.weight", [2**63, 1])]),
     r"dimension 0 is 9223372036854775808: larger than the file"),
    ("n-dims-1000", gguf_bytes(tensors=[tensor_info("a.weight", [1] * 4, n_dims=1000)]),
     r"tensor 'a\.weight' has 1000 dimensions: GGUF allows at most 4"),
    ("n-dims-20", gguf_bytes(tensors=[tensor_info("a.weight", [1] * 20)]),
     r"has 20 dimensions"),
    ("unknown-type", gguf_bytes(tensors=[tensor_info("a.weight", [32], kind=99)]),
     r"tensor a\.weight has type unknown type 99, which cannot be imported"),
    ("deprecated-type-4", gguf_bytes(tensors=[tensor_info("a.weight", [32], kind=4)]),
     r"has type unknown type 4"),
    ("tensor-count-2^64", gguf_bytes(num_tensors=2**64 - 1),
     r"the tensor count is 18446744073709551615: more than the limit of 65536"),
    ("tensor-count-past-file", gguf_bytes(num_tensors=5000),
     r"the tensor count is 5000, but only \d+ bytes remain .*truncated or corrupt"),
    ("kv-count-2^63", gguf_bytes(num_kvs=2**63), r"the metadata key count is 9223372036854775808"),
    ("kv-count-past-file", gguf_bytes(num_kvs=60000), r"metadata key count is 60000, but only"),
    ("key-length-2^63", gguf_bytes(kvs=[struct.pack("<Q", 2**63) + b"x" * 16]),
     r"the name of metadata key 0 is 9223372036854775808 bytes long"),
    ("key-length-past-file", gguf_bytes(kvs=[struct.pack("<Q", 4096) + b"x" * 16]),
     r"the name of metadata key 0 needs 4096 bytes but only \d+ remain.*truncated"),
    ("string-value-2^64", gguf_bytes(kvs=[kv("k", STRING, struct.pack("<Q", 2**64 - 1))]),
     r"the value of 'k' is 18446744073709551615 bytes long"),
    ("array-length-2^62", gguf_bytes(kvs=[kv("k", ARRAY, struct.pack("<IQ", U8, 2**62))]),
     r"the length of array 'k' is 4611686018427387904: more than the limit"),
    ("array-length-past-file", gguf_bytes(kvs=[kv("k", ARRAY, struct.pack("<IQ", U64, 10**6))]),
     r"the length of array 'k' is 1000000, but only \d+ bytes remain"),
    ("string-array-past-file", gguf_bytes(kvs=[kv("k", ARRAY, struct.pack("<IQ", STRING, 10**6))]),
     r"the length of array 'k' is 1000000, but only"),
    ("nested-arrays-deep", gguf_bytes(kvs=[kv("k", ARRAY, nested_array(100_000))]),
     r"metadata 'k' is an array of arrays"),
    ("unknown-value-type", gguf_bytes(kvs=[kv("k", 13, b"\0" * 8)]),
     r"metadata 'k' has unknown value type 13"),
    ("key-not-utf8", gguf_bytes(kvs=[kv(b"\xff\xfe", U8, b"\0")]),
     r"the name of metadata key 0 is not valid UTF-8"),
    ("duplicate-key", gguf_bytes(kvs=[ARCH, ARCH]),
     r"metadata key 'general\.architecture' appears twice"),
    ("offset-past-end", gguf_bytes(tensors=[tensor_info("a.weight", [8, 2], offset=2**40)]),
     r"truncated: tensor a\.weight extends past the end of the file"),
    # data_off + offset wraps around 2^64 in the native reader.
    ("offset-wraps", gguf_bytes(tensors=[tensor_info("a.weight", [8, 2], offset=2**64 - 32)]),
     r"extends past the end of the file"),
    ("offset-misaligned", gguf_bytes(tensors=[tensor_info("a.weight", [8, 2], offset=3)]),
     r"tensor 'a\.weight' data offset 3 is not a multiple of the alignment 32"),
    ("tensors-overlap", gguf_bytes(tensors=[tensor_info("a.weight", [8, 2]),
                                            tensor_info("b.weight", [8, 1], offset=32)]),
     r"tensors 'a\.weight' and 'b\.weight' overlap"),
    ("duplicate-tensor", gguf_bytes(tensors=[GOOD_TENSOR, tensor_info("a.weight", [8], offset=64)],
                                    data=b"\0" * 96),
     r"tensor 'a\.weight' appears twice"),
    ("alignment-zero", gguf_bytes(kvs=[ARCH, kv("general.alignment", U32, struct.pack("<I", 0))]),
     r"general\.alignment is 0: it must be a power of two"),
    ("alignment-not-power-of-two",
     gguf_bytes(kvs=[kv("general.alignment", U32, struct.pack("<I", 48))], alignment=48),
     r"general\.alignment is 48"),
    ("alignment-wrong-type", gguf_bytes(kvs=[kv("general.alignment", U64, struct.pack("<Q", 32))]),
     r"general\.alignment must be a uint32"),
    ("data-start-past-end",
     gguf_bytes(kvs=[kv("general.alignment", U32, struct.pack("<I", 65536))],
                tensors=[tensor_info("a.weight", [0])], data=b"", alignment=1),
     r"the tensor data would start at byte 65536, past the end of the file"),
    ("q4-rows-not-whole-blocks", gguf_bytes(tensors=[tensor_info("a.weight", [31, 1], kind=Q4_0)]),
     r"tensor a\.weight \(Q4_0\) has rows of 31, not a multiple of its block size 32"),
    ("bad-version", b"GGUF" + struct.pack("<IQQ", 7, 0, 0), r"GGUF version 7 is not supported"),
    ("bad-magic", b"GGML" + b"\0" * 60, r"not a GGUF file"),
    ("empty", b"", r"not a GGUF file \(it is empty\)"),
]  # fmt: skip


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    return path


def test_the_baseline_file_is_valid(tmp_path: Path) -> None:
    # Each crafted file differs from this one in the field under attack only.
    header = read_header(write(tmp_path, "good", gguf_bytes()))
    assert header.metadata == {"general.architecture": "llama"}
    assert [(t.name, t.shape, t.type_name) for t in header.tensors] == [("a.weight", (2, 8), "F32")]


@pytest.mark.parametrize(("name", "data", "says"), CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_header_is_a_clear_error(tmp_path: Path, name: str, data: bytes, says: str) -> None:
    path = write(tmp_path, name, data)
    start = time.perf_counter()
    with pytest.raises(ImportFailedError, match=says) as raised:
        read_header(path)
    assert time.perf_counter() - start < 1.0
    assert raised.value.message.startswith(f"{name}.gguf")  # names the file


def test_every_truncation_of_a_valid_file_is_a_clear_error(tmp_path: Path) -> None:
    tokens = kv("tokens", ARRAY, struct.pack("<IQ", STRING, 2) + gstr("a") * 2)
    data = gguf_bytes(kvs=[ARCH, tokens])
    for size in range(len(data)):
        path = write(tmp_path, "cut", data[:size])
        with pytest.raises(ImportFailedError, match=r"truncated|not a GGUF file"):
            read_header(path)


@pytest.mark.spawns
def test_cli_import_of_an_attack_exits_with_the_reason(
    tmp_path: Path, tiny_llama_gguf: tuple[bytes, int]
) -> None:
    # The CLI imports in-process: type 4 would kill it with SIGFPE inside mlx.
    _, data, _ = next(a for a in model_attacks(tiny_llama_gguf[0]) if a[0] == "type-4")
    source = write(tmp_path, "type-4", data)
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path / "base")]
    args = ["models", "import-gguf", str(source), "--name", "attack"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "omlx: type-4.gguf: tensor output_norm.weight has type unknown type 4" in proc.stderr


# Runs import_gguf on each path and prints one JSON line per file: [stem, exception, message].
_IMPORT_SCRIPT = """
import json, sys, shutil
from pathlib import Path
from omlx.models.gguf import import_gguf
out = Path(sys.argv[1])
for path in map(Path, sys.argv[2:]):
    try:
        import_gguf(path, out / path.stem, dtype="float32")
        result = ["ok", ""]
    except Exception as exc:
        result = [type(exc).__name__, getattr(exc, "message", str(exc))]
    shutil.rmtree(out / path.stem, ignore_errors=True)
    print(json.dumps([path.stem, *result]), flush=True)
"""


def _import_in_subprocess(tmp_path: Path, paths: list[Path]) -> dict[str, tuple[str, str]]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_SCRIPT, str(out), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    # A negative code is a signal: mlx's native reader crashed on a file we let through.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    return {stem: (kind, msg) for stem, kind, msg in map(json.loads, proc.stdout.splitlines())}


# ---------------------------------------------------------------- mutations of a real model


def tiny_llama_gguf_bytes(folder: Path) -> bytes:
    """A complete tiny llama GGUF, written by llama.cpp's own gguf package."""
    from tests.unit.test_gguf_import import (
        MIXED_TYPES,
        gguf_tensors,
        random_weights,
        train_tokenizer,
        write_gguf,
    )

    tokenizer = train_tokenizer("smollm")
    weights = random_weights(tokenizer.get_vocab_size())
    path = write_gguf(
        folder / "tiny.gguf", tokenizer, gguf_tensors(weights, MIXED_TYPES, tied=False)
    )
    return path.read_bytes()


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """The tiny llama GGUF and its header size (where its tensor data starts)."""
    gguf = pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("tiny-gguf")
    data = tiny_llama_gguf_bytes(folder)
    return data, int(gguf.GGUFReader(str(folder / "tiny.gguf")).data_offset)


def patch(data: bytes, pos: int, fmt: str, *values: int) -> bytes:
    return data[:pos] + struct.pack(fmt, *values) + data[pos + struct.calcsize(fmt) :]


def tensor_fields(data: bytes, name: str, num_dims: int) -> dict[str, int]:
    """Byte positions of one tensor's n_dims, dims, type and offset in the table."""
    n_dims = data.index(gstr(name)) + len(gstr(name))
    type_pos = n_dims + 4 + 8 * num_dims
    return {"n_dims": n_dims, "dims": n_dims + 4, "type": type_pos, "offset": type_pos + 4}


def model_attacks(data: bytes) -> list[tuple[str, bytes, str]]:
    """In-place edits of one field of a complete model: everything else stays valid,
    so without the header checks each file reaches mlx's native reader."""
    norm = tensor_fields(data, "output_norm.weight", 1)  # F32 [64]
    embed = tensor_fields(data, "token_embd.weight", 2)
    norm_offset = struct.unpack_from("<Q", data, norm["offset"])[0]
    embed_offset = struct.unpack_from("<Q", data, embed["offset"])[0]
    tokens = data.index(gstr("tokenizer.ggml.tokens")) + len(gstr("tokenizer.ggml.tokens")) + 8
    return [
        ("n-dims-20", patch(data, norm["n_dims"], "<I", 20), r"has 20 dimensions|needs|larger"),
        ("type-4", patch(data, norm["type"], "<I", 4), r"has type unknown type 4"),
        ("type-99", patch(data, norm["type"], "<I", 99), r"has type unknown type 99"),
        ("dims-wrap", patch(data, embed["dims"], "<QQ", 2**32, 2**32),
         r"dimension 0 is 4294967296: larger than the file"),
        ("offset-wraps", patch(data, norm["offset"], "<Q", 2**64 - 32), r"extends past the end"),
        ("offset-misaligned", patch(data, norm["offset"], "<Q", norm_offset + 3),
         r"is not a multiple of the alignment 32"),
        ("overlap", patch(data, norm["offset"], "<Q", embed_offset), r"overlap"),
        ("tensor-count", patch(data, 8, "<Q", 2**64 - 1),
         r"the tensor count is 18446744073709551615"),
        ("key-count", patch(data, 16, "<Q", 2**63),
         r"the metadata key count is 9223372036854775808"),
        ("token-count", patch(data, tokens, "<Q", 2**62),
         r"array 'tokenizer\.ggml\.tokens' is 4611686018427387904"),
    ]  # fmt: skip


@pytest.mark.spawns
def test_attacks_on_a_complete_model_fail_the_whole_import_without_crashing(
    tmp_path: Path, tiny_llama_gguf: tuple[bytes, int]
) -> None:
    """The whole import (mx.load included) of each attack, in a child that must survive."""
    attacks = model_attacks(tiny_llama_gguf[0])
    paths = [write(tmp_path, name, data) for name, data, _ in attacks]
    paths.append(write(tmp_path, "unpatched", tiny_llama_gguf[0]))
    results = _import_in_subprocess(tmp_path, paths)
    assert results.pop("unpatched") == ("ok", "")
    for name, _, says in attacks:
        kind, message = results[name]
        assert kind == "ImportFailedError", (name, kind, message)
        assert message.startswith(f"{name}.gguf: ") and re.search(says, message), message


EXTREMES = [0, 1, 2**31, 2**32, 2**63, 2**64 - 1]


def mutate(data: bytes, header_bytes: int, rng: random.Random) -> bytes:
    """A few header edits: random bytes, or an extreme u64 (a count, length or offset)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(header_bytes - 8)
        if rng.random() < 0.5:
            out[pos] = rng.randrange(256)
        else:
            out[pos : pos + 8] = struct.pack("<Q", rng.choice(EXTREMES))
    if rng.random() < 0.1:
        del out[rng.randrange(len(out)) :]
    return bytes(out)


def _header_steps(path: Path) -> GGUFHeader:
    """The import's pure-Python steps: header, config, tokenizer."""
    header = read_header(path)
    config = build_config(header)
    build_tokenizer(header.metadata, model_max_length=config["max_position_embeddings"])
    return header


def test_mutated_headers_parse_or_fail_clearly(
    tmp_path: Path, tiny_llama_gguf: tuple[bytes, int]
) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    strategies = hypothesis.strategies
    data, header_bytes = tiny_llama_gguf

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(seed=strategies.integers(0, 2**32))
    def check(seed: int) -> None:
        path = write(tmp_path, "mutated", mutate(data, header_bytes, random.Random(seed)))
        start = time.perf_counter()
        with contextlib.suppress(ImportFailedError):  # the only exception allowed
            _header_steps(path)
        assert time.perf_counter() - start < 1.0

    check()


@pytest.mark.spawns
def test_mutated_files_never_crash_the_full_import(
    tmp_path: Path, tiny_llama_gguf: tuple[bytes, int]
) -> None:
    data, header_bytes = tiny_llama_gguf
    rng = random.Random(20240522)
    paths = [write(tmp_path, f"m{i:03d}", mutate(data, header_bytes, rng)) for i in range(150)]
    paths.append(write(tmp_path, "unmutated", data))
    results = _import_in_subprocess(tmp_path, paths)
    assert results["unmutated"] == ("ok", "")
    assert len(results) == len(paths)
    unexpected = {k: v for k, v in results.items() if v[0] not in ("ok", "ImportFailedError")}
    assert not unexpected
    # The mutations reach many different checks, not one early refusal.
    assert len({msg.split(":")[1] for kind, msg in results.values() if ":" in msg}) >= 10


# ---------------------------------------------------------------- the import child


def run_child(fn: Callable[..., object], *args: object, limit: int = 1 << 30, tracker=None):
    return run_in_child(fn, *args, memory_limit_bytes=limit, tracker=tracker)


@pytest.mark.spawns
def test_child_returns_its_result() -> None:
    assert run_child(allocate, 1 << 20) == 1 << 20


@pytest.mark.spawns
def test_child_over_its_memory_limit_is_a_clear_error() -> None:
    # 4 GiB against a 1 GiB limit: refused at once, not swapped in.
    with pytest.raises(ImportFailedError, match="the import ran out of memory: it may use 1"):
        run_child(allocate, 4 << 30)


@pytest.mark.spawns
def test_child_errors_keep_their_message_and_field() -> None:
    with pytest.raises(ImportFailedError, match=r"^bad header$") as raised:
        run_child(refuse, "bad header")
    assert raised.value.param == "path"


@pytest.mark.spawns
def test_a_killed_child_is_a_clear_error() -> None:
    with pytest.raises(ImportFailedError, match=r"stopped by SIGKILL.*server itself is unaffected"):
        run_child(die)


@pytest.mark.spawns
def test_child_memory_counts_in_the_probe_while_it_runs() -> None:
    probe = MemoryProbe(max_age_s=0.0)
    alone = probe.reading(fresh=True).process_footprint_bytes
    held = 256 << 20
    worker = threading.Thread(
        target=run_child, args=(hold_memory, held, 4.0), kwargs={"tracker": probe}
    )
    worker.start()
    peak, deadline = 0, time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:
        peak = max(peak, probe.reading(fresh=True).process_footprint_bytes - alone)
        time.sleep(0.05)
    worker.join()
    assert peak >= held * 0.9
    assert probe.reading(fresh=True).process_footprint_bytes - alone < held * 0.5  # untracked
