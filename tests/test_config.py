"""Config composition, levers and CLI error paths (no model load needed for these)."""
import subprocess
import sys

import pytest

from metrale.__main__ import main
from metrale.settings import ConfigError, compose, to_overrides


def test_defaults_compose():
    cfg = compose()
    assert cfg.model == "smollm2-135m" and cfg.device == "auto"
    assert cfg.levers.no_mix is False and cfg.cache.block_size == 16


def test_lever_override_and_preset():
    cfg = compose(["levers.no_mix=true", "+lever=exact"])
    assert cfg.levers.no_mix is True
    assert cfg.levers.numpy_dtype == "float64"
    cfg = compose(["+lever=bisect"])
    assert cfg.levers.cuda_graphs is False and cfg.levers.prefix_caching is False


def test_library_dict_overrides_match_cli():
    from_dict = compose(to_overrides({"levers": {"graph_batch_sizes": [1, 3]}, "prompt": "it's a=b"}))
    from_cli = compose(["levers.graph_batch_sizes=[1,3]", "prompt='it\\'s a=b'"])
    assert list(from_dict.levers.graph_batch_sizes) == [1, 3] == list(from_cli.levers.graph_batch_sizes)
    assert from_dict.prompt == "it's a=b" == from_cli.prompt


@pytest.mark.parametrize("override, needle", [
    ("levers.turbo=1", "unknown lever 'levers.turbo'; valid levers: "),
    ("levers.no_mix=maybe", "levers.no_mix"),
    ("max_tokens=lots", "max_tokens"),
    ("nonsense=1", "unknown setting 'nonsense'"),
    ("+lever=nope", "unknown lever preset 'nope'"),
    ("cache.bogus=1", "valid settings of cache"),
])
def test_bad_overrides_name_the_problem(override, needle):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert needle in str(err.value)


def test_cli_bad_lever_is_one_line_not_a_traceback(capsys):
    assert main(["levers.turbo=1"]) == 2
    err = capsys.readouterr().err
    assert "valid levers" in err and "Traceback" not in err and "no_mix" in err


@pytest.mark.parametrize("args, needle", [
    (["max_tokens=0"], "max_tokens"),
    (["prompt= "], "prompt: is empty"),
    (["model=no-such-model"], "unknown model 'no-such-model'"),
    (["model=/definitely/not/here.gguf"], "no such path"),
    (["sampling.temperature=-1"], "temperature"),
])
def test_cli_bad_inputs(args, needle, capsys):
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_cli_cfg_job_shows_resolved_config():
    out = subprocess.run([sys.executable, "-m", "metrale", "levers.no_mix=true", "--cfg", "job"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no_mix: true" in out.stdout and "model: smollm2-135m" in out.stdout
