"""K-quant and SentencePiece GGUFs, imported through a real server's admin API, answer /v1.

The files are written here (tests/fixtures/gguf_files.py) from tiny random
mlx-lm models in llama.cpp's Q4_K_M mix: a Qwen 3 with a byte-level BPE
tokenizer and a Llama with a SentencePiece one. The import runs in the
server's import child, and the imported model answers a chat completion.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from omlx.api.server import Server
from tests.fixtures.gguf_files import finish, train_sentencepiece, write_model_gguf
from tests.fixtures.servers import ROOT, live_server
from tests.fixtures.tiny_models import build_tiny_model

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")
Q = gguf.GGMLQuantizationType
Q4_K_M = {".v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "default": Q.Q4_K}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-files")
    qwen = build_tiny_model(root / "qwen3", "gguf-qwen3")
    write_model_gguf(qwen, root / "tiny-qwen3.Q4_K_M.gguf", Q4_K_M)
    sp_model = train_sentencepiece(root)
    size = spm.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size()
    llama = build_tiny_model(root / "llama", "gguf-llama", vocab_size=size)
    write_model_gguf(llama, root / "tiny-llama-sp.Q4_K_M.gguf", Q4_K_M, sentencepiece=sp_model)
    return {
        "qwen3": root / "tiny-qwen3.Q4_K_M.gguf",
        "llama-sp": root / "tiny-llama-sp.Q4_K_M.gguf",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("models")
    with live_server(tmp_path_factory.mktemp("base"), models) as srv:
        yield srv


@pytest.mark.parametrize(
    ("which", "dtype", "q4_k_became"),
    [
        ("qwen3", "keep", "kept as MLX 4-bit affine, group 32 (exact)"),
        ("llama-sp", "float32", "dequantized to float32"),
    ],
)
def test_imported_gguf_answers_a_chat_completion(
    server: Server, gguf_files: dict[str, Path], which: str, dtype: str, q4_k_became: str
) -> None:
    name = f"imported-{which}"
    response = httpx.post(
        server.base_url + "/admin/api/models/import-gguf",
        json={"path": str(gguf_files[which]), "name": name, "dtype": dtype},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    conversion = response.json()["conversion"]
    assert conversion["tensor_types"]["Q4_K"]["became"] == q4_k_became
    assert conversion["dtype"] == dtype and conversion["gguf_bytes"] > 0

    listed = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    assert name in [m["id"] for m in listed]
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens"] > 3 and body["usage"]["completion_tokens"] >= 1


def test_an_unsupported_tensor_type_is_a_400_naming_it(server: Server, tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "ints.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.int32))
    finish(writer)
    response = httpx.post(
        server.base_url + "/admin/api/models/import-gguf",
        json={"path": str(tmp_path / "ints.gguf"), "name": "ints"},
        timeout=300,
    )
    assert response.status_code == 400
    assert (
        "token_embd.weight has type I32, which cannot be imported"
        in response.json()["error"]["message"]
    )


def test_cli_import_says_what_became_of_each_type(
    gguf_files: dict[str, Path], tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path / "base")]
    args = ["models", "import-gguf", str(gguf_files["qwen3"]), "--name", "q", "--dtype", "keep"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(qwen3)" in proc.stdout
    assert "Q4_K: 11 tensors kept as MLX 4-bit affine, group 32 (exact)" in proc.stdout
    assert "Q6_K: 5 tensors requantized to MLX 8-bit affine, group 32" in proc.stdout
