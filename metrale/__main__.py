"""CLI: `python -m metrale [key=value ...] [+lever=<preset>] [--cfg job]`.

Examples:
  python -m metrale prompt="What is the capital of France?" chat=true max_tokens=20
  python -m metrale sampling.temperature=0.7 sampling.seed=1 levers.no_mix=true
  python -m metrale model=/path/to/model.gguf device=cpu --cfg job
  python -m metrale serve server.port=8000     (the OpenAI-compatible HTTP server; serve --help)
  python -m metrale bench=decode -m levers.numpy_dtype=float32,float64 model=tiny-shape device=cpu
                                              (a lever sweep, one bench record a point: bench/sweep_cli.py)
Errors in settings or requests print one line and exit with status 2, never a traceback.
"""
from __future__ import annotations

import logging
import sys
import time

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from metrale.server.serve import main as serve
        return serve(argv[1:])
    if any(a.startswith(("bench=", "+sweep=")) for a in argv):   # a lever sweep (bench/sweep_cli.py)
        try:
            from bench.sweep_cli import main as sweep
        except ImportError:
            return _fail("bench=...: run from a metrale checkout (the bench/ package holds the harness)")
        return sweep(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    cfg, code = config_from_argv(argv)
    if cfg is None:
        return code
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    if max(int(cfg.parallel.tensor), int(cfg.parallel.expert)) > 1:   # one process a rank (parallel/tp.py)
        from metrale.parallel.tp import main as ranks_main
        return ranks_main(argv)
    return _generate(cfg)


def config_from_argv(argv: list[str]):
    """(config, None) to go on with, or (None, exit status) after `--cfg job` or a bad setting."""
    argv = list(argv)
    show_cfg = "--cfg" in argv
    if show_cfg:
        i = argv.index("--cfg")
        del argv[i:i + 2]
    from metrale.settings import ConfigError, compose, to_yaml
    try:
        cfg = compose(argv)
    except ConfigError as exc:
        return None, _fail(f"bad setting: {exc}")
    if show_cfg:
        print(to_yaml(cfg), end="")
        return None, 0
    return cfg, None


def _generate(cfg) -> int:
    from metrale.engine import Engine
    from metrale.models.registry import ModelNotFoundError
    from metrale.sampling.params import InvalidRequestError
    try:  # refuse a bad request before spending seconds on loading the model
        if not str(cfg.prompt).strip():
            raise InvalidRequestError("prompt: is empty")
        Engine.params_from_config(cfg).validate(vocab_size=2**31 - 1)
    except InvalidRequestError as exc:
        return _fail(f"bad request: {exc}")
    try:
        engine = Engine(cfg=cfg)
    except (ModelNotFoundError, ValueError, RuntimeError) as exc:
        return _fail(str(exc))
    print(f"[metrale] {engine.model_config.name} on {engine.backend.name}, "
          f"loaded in {engine.load_seconds:.2f} s", file=sys.stderr)
    params = engine.default_params()
    t0 = time.perf_counter()
    n = 0
    reason = None
    try:
        if cfg.stream:
            for delta in engine.stream(cfg.prompt, params, chat=cfg.chat):
                print(delta.text, end="", flush=True)
                n += len(delta.token_ids)
                reason = delta.finish_reason
            print()
        else:
            out = engine.generate([cfg.prompt], params, chat=cfg.chat, use_tqdm=False)[0]
            print(out.text)
            n, reason = len(out.token_ids), out.finish_reason
    except InvalidRequestError as exc:
        return _fail(f"bad request: {exc}")
    dt = time.perf_counter() - t0
    print(f"[metrale] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), finish_reason={reason}",
          file=sys.stderr)
    return 0 if reason is None or not reason.startswith("error") else 1


def _fail(message: str) -> int:
    print(f"metrale: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
