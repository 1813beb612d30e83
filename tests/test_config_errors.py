"""Every setting is checked at composition: a bad value is one line naming the setting and its
valid values (ConfigError; the CLI prints it and exits 2, no traceback). And every
`python -m metrale ...` example of the README parses through the CLI's config path."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from metrale.__main__ import config_from_argv, main
from metrale.settings import ConfigError, compose

README = Path(__file__).resolve().parents[1] / "README.md"

BAD = [
    ("cache.block_size=0", "cache.block_size", ">= 1"),
    ("cache.block_size=-4", "cache.block_size", ">= 1"),
    ("cache.num_blocks=-5", "cache.num_blocks", ">= 1"),
    ("cache.num_blocks=0", "cache.num_blocks", ">= 1"),
    ("cache.gpu_memory_utilization=1.5", "cache.gpu_memory_utilization", "(0, 1]"),
    ("cache.cpu_kv_tokens=0", "cache.cpu_kv_tokens", ">= 1"),
    ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs", ">= 1"),
    ("scheduler.max_num_batched_tokens=0", "scheduler.max_num_batched_tokens", ">= 1"),
    ("scheduler.max_model_len=0", "scheduler.max_model_len", ">= 1"),
    ("levers.gemm_library=fastest", "levers.gemm_library", "auto, numba, cublaslt"),
    ("levers.decode_attention_kernel=xyz", "levers.decode_attention_kernel", "mma, fma"),
    ("levers.prefill_attention_kernel=xyz", "levers.prefill_attention_kernel", "mma, fma"),
    ("levers.pdl_trigger=sometimes", "levers.pdl_trigger", "auto, early, late, exit"),
    ("spec.gate.measured=maybe", "spec.gate.measured", "auto, on, off"),
    ("levers.preempt_mode=kill", "levers.preempt_mode", "recompute, abort"),
    ("levers.numpy_dtype=float16", "levers.numpy_dtype", "float32, float64"),
    ("levers.graph_batch_sizes=[1,0]", "levers.graph_batch_sizes", ">= 1"),
    ("device=tpu", "device", "auto, cpu, cuda"),
    ("spec.method=telepathy", "spec.method", "none, ngram, self, draft, mtp, dflash"),
    ("spec.num_drafts=0", "spec.num_drafts", ">= 1"),
    ("spec.ngram_min_n=0", "spec.ngram_min_n", ">= 1"),
    ("log_level=chatty", "log_level", "DEBUG"),
]


@pytest.mark.parametrize("override, setting, valid", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_refused_at_composition_naming_the_setting(override, setting, valid):
    with pytest.raises(ConfigError) as err:
        compose([override])
    msg = str(err.value)
    assert msg.startswith(setting + ":") and valid in msg and "\n" not in msg


@pytest.mark.parametrize("override, setting, valid", BAD[:2] + BAD[9:11], ids=[b[0] for b in BAD[:2] + BAD[9:11]])
def test_cli_prints_one_line_and_exits_2(override, setting, valid, capsys):
    assert main([override, "max_tokens=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and setting in err and valid in err and "Traceback" not in err


def test_the_library_refuses_them_too():
    from metrale import Engine
    with pytest.raises(ConfigError, match=r"^cache\.block_size"):
        Engine(model="smollm2-135m", device="cpu", cache={"block_size": 0})
    with pytest.raises(ConfigError, match=r"^levers\.gemm_library"):
        Engine(model="smollm2-135m", device="cpu", levers={"gemm_library": "bogus"})


def test_renamed_settings_keep_their_old_names():
    """The gate and state levers moved to spec.gate.* and state.*; their old names still work."""
    from metrale.settings import RENAMED
    cfg = compose(["levers.spec_measured_gate=off", "levers.spec_min_gain=1.3", "levers.state_snapshots=5"])
    assert cfg.spec.gate.measured == "off" and cfg.spec.gate.min_gain == 1.3 and cfg.state.snapshots == 5
    assert "spec_min_gain" not in cfg.levers
    with pytest.raises(ConfigError, match="^spec.gate.measured: 'maybe'"):
        compose(["levers.spec_measured_gate=maybe"])
    cfg = compose([])
    for old, new in RENAMED.items():                # every new name is in the schema, and no old one
        group, name = new.rsplit(".", 1)
        assert name in OmegaConf.select(cfg, group), new
        assert old.split(".", 1)[1] not in cfg.levers, old


def test_good_values_compose():
    cfg = compose(["levers.gemm_library=cublaslt", "levers.pdl_trigger=late", "spec.gate.measured=on",
                   "device=cpu", "log_level=info", "cache.num_blocks=12", "scheduler.max_model_len=64"])
    assert cfg.levers.gemm_library == "cublaslt" and cfg.cache.num_blocks == 12


def readme_cli_examples() -> list[str]:
    """Every `python -m metrale ...` of the README (code blocks and inline code), comments dropped."""
    text = README.read_text()
    found = re.findall(r"^(python -m metrale\b.*)$", text, flags=re.M)
    found += re.findall(r"`(python -m metrale\b[^`]*)`", text)
    out = []
    for line in found:
        line = re.sub(r"\s+#.*$", "", line.strip())
        if line not in out:
            out.append(line)
    return out


def test_readme_has_cli_examples():
    examples = readme_cli_examples()
    assert len(examples) >= 5 and any("spec.method=ngram" in e for e in examples)


@pytest.mark.parametrize("example", readme_cli_examples())
def test_readme_cli_example_parses(example, capsys):
    """The shell's word splitting, then the CLI's own config path (bench sweeps and serve take the
    same key=value overrides, minus their own flags)."""
    argv = shlex.split(example)[3:]
    if argv and argv[0] == "serve":
        argv = argv[1:]
    argv = [a for a in argv if a != "-m"]
    if any(a.startswith("bench=") for a in argv):
        argv = [a for a in argv if not a.startswith("bench=")]
        argv = [a.split("=", 1)[0] + "=" + a.split("=", 1)[1].split(",")[0] if "," in a and "=" in a else a
                for a in argv]
    cfg, code = config_from_argv(argv + (["--cfg", "job"] if "--cfg" not in argv else []))
    err = capsys.readouterr().err
    assert code == 0, f"{example}: {err}"
