"""Run Transformer Engine's PyTorch tests on the CPU against te_compile (issue 44's measure).

    nice -n 15 python -m bench.te_tests.run [FILE[:STRIDE] ...] [--out summary.md]

TE's tests are taken from a mirror of its repository (never copied into this one), patched
where they hard-code the device, and run per file with pytest, the shim of
``bench/te_tests/shim`` on ``sys.path`` (``import transformer_engine.pytorch`` is te_compile)
and ``bench/te_tests/conftest.py`` beside them. Each file runs a deterministic sample: a test
runs when the crc32 of its node id is 0 modulo the file's stride. The JUnit XML of each run is
parsed into a Markdown summary: per file collected / sampled / passed / failed / skipped and
pass rates, and the failure causes (first line of each exception) classified as the shim's
(a TE internal te_compile lacks, or a stand-in of the shim's), a limit of the machine (the
per-test alarm, memory), or te_compile's.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHIM = HERE / "shim"
DEFAULT_MIRROR = "/work/.mirror/NVIDIA+TransformerEngine/repo"
TEST_DIR = "tests/pytorch"

#: The seven files of the 2026-11-29 measurement, with strides small enough for a loaded
#: 2-core machine (about 25 minutes in all).
DEFAULT_FILES = (
    "test_float8_current_scaling_exact.py:1",
    "test_recipe.py:4",
    "test_torch_compile.py:4",
    "test_numerics.py:200",
    "test_grouped_linear.py:80",
    "test_fusible_ops.py:80",
    "test_sanity.py:400",
)

#: Per-test alarm (seconds) per file; other files get --test-timeout.
TEST_TIMEOUTS = {
    "test_numerics.py": 90,
    "test_recipe.py": 60,
    "test_float8_current_scaling_exact.py": 60,
}

#: Extra pytest arguments per file: test_recipe.py's 8192 x 8192 cases take minutes each on
#: the CPU.
EXTRA_ARGS = {"test_recipe.py": ["-k", "not 8192"]}

#: Device patches applied to every extracted file: (pattern, replacement).
DEVICE_PATCHES = (
    ('"cuda"', '"cpu"'),
    ("'cuda'", "'cpu'"),
    ('"cuda:0"', '"cpu"'),
    (".cuda()", ".cpu()"),
)

#: Collection stoppers, per file: (old, new), each must apply. A module-level construction
#: with a field te_compile lacks is built through the conftest's ``shim_build`` (the error is
#: raised again in the tests that use it); the opaque-quantizer tests of test_torch_compile.py
#: register TE's quantizer classes as torch opaque types, so they are switched off (they skip).
FILE_PATCHES = {
    "test_grouped_linear.py": (
        (
            "recipe.MXFP8BlockScaling(enable_2d_quantization=True)",
            'shim_build("MXFP8BlockScaling(enable_2d_quantization=True)", '
            "recipe.MXFP8BlockScaling, enable_2d_quantization=True)",
        ),
    ),
    "test_torch_compile.py": (("    _opaque_available = True", "    _opaque_available = False"),),
}
FILE_IMPORTS = {"test_grouped_linear.py": "from conftest import shim_build\n"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.te_tests.run",
        description=__doc__.split("\n\n")[0] + " Writes a Markdown summary.",
    )
    p.add_argument(
        "files",
        nargs="*",
        default=list(DEFAULT_FILES),
        help="TE test files under tests/pytorch, each as NAME[:STRIDE] (a test runs when "
        "crc32(node id) %% STRIDE == 0; default 1). Default: " + " ".join(DEFAULT_FILES),
    )
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help="TE git repository (%(default)s)")
    p.add_argument("--commit", default="HEAD", help="TE commit to read (%(default)s)")
    p.add_argument("--te-compile", default=str(REPO), help="te_compile tree (%(default)s)")
    p.add_argument("--out", default=None, help="Markdown summary path (default: stdout only)")
    p.add_argument("--json", default=None, help="also write the raw results as JSON here")
    p.add_argument("--workdir", default=None, help="keep the extracted tests and XML here")
    p.add_argument("--file-timeout", type=int, default=1500, help="seconds per file (%(default)s)")
    p.add_argument(
        "--test-timeout",
        type=int,
        default=120,
        help="per-test alarm, seconds, where TEST_TIMEOUTS has none (%(default)s)",
    )
    p.add_argument(
        "--mem-gb",
        type=float,
        default=0.0,
        help="address-space limit per pytest run in GiB (0: none)",
    )
    return p.parse_args(argv)


def extract(mirror: str, commit: str, dest: Path) -> Path:
    """TE's ``tests/pytorch`` at ``commit`` under ``dest``."""
    data = subprocess.run(
        ["git", "-C", mirror, "archive", commit, TEST_DIR],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    head = subprocess.run(
        ["git", "-C", mirror, "rev-parse", "--short=9", commit],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (dest / "TE_COMMIT").write_text(head + "\n")
    return dest / TEST_DIR


def _insert_import(text: str, line: str) -> str:
    """``line`` before the first import that is not ``from __future__``."""
    m = re.search(r"^(?:import |from (?!__future__))", text, flags=re.M)
    pos = m.start() if m else 0
    return text[:pos] + line + text[pos:]


def patch(test_dir: Path) -> dict[str, int]:
    """Apply the device patches to every .py file and the per-file patches; the count of
    replacements per file."""
    counts = {}
    for path in sorted(test_dir.rglob("*.py")):
        text = path.read_text()
        n = 0
        for old, new in DEVICE_PATCHES:
            n += text.count(old)
            text = text.replace(old, new)
        name = path.name if path.parent == test_dir else None
        for old, new in FILE_PATCHES.get(name, ()):
            if old not in text:
                raise SystemExit(f"patch for {name} no longer applies: {old!r}")
            n += text.count(old)
            text = text.replace(old, new)
        if name in FILE_IMPORTS:
            text = _insert_import(text, FILE_IMPORTS[name])
        path.write_text(text)
        counts[str(path.relative_to(test_dir))] = n
    shutil.copy(HERE / "conftest.py", test_dir / "conftest.py")
    return counts


def _limit_memory(gib: float):
    if gib <= 0:
        return None

    def preexec():
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return preexec


def run_file(test_dir: Path, name: str, stride: int, args, xml: Path) -> dict:
    counts = xml.with_suffix(".counts.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM), args.te_compile] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env["TE_SHIM_PATH"] = str(SHIM)
    env["TE_SAMPLE_STRIDE"] = str(stride)
    env["TE_SHIM_TIMEOUT"] = str(TEST_TIMEOUTS.get(name, args.test_timeout))
    env["TE_SHIM_COUNTS"] = str(counts)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:xdist",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--rootdir={test_dir}",
        f"--junitxml={xml}",
        *EXTRA_ARGS.get(name, []),
        name,
    ]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=test_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.file_timeout,
            preexec_fn=_limit_memory(args.mem_gb),
        )
        tail, rc = (proc.stdout + proc.stderr)[-3000:], proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        tail = out.decode(errors="replace")[-3000:] if isinstance(out, bytes) else out[-3000:]
        rc = "timeout"
    result = {"file": name, "stride": stride, "rc": rc, "seconds": time.monotonic() - t0}
    result.update(json.loads(counts.read_text()) if counts.exists() else {})
    result["tests"] = parse_junit(xml) if xml.exists() else []
    if not xml.exists():
        result["tail"] = tail
    return result


def parse_junit(xml: Path) -> list[dict]:
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message, where, stub_seen = "passed", "", "", False
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = child.get("message") or (child.text or "").strip()
                # the file of the innermost frame pytest reports ("path.py:LINE: ErrorType")
                frames = re.findall(r"^(\S+\.py):\d+: \w", child.text or "", flags=re.M)
                where = frames[-1] if frames else ""
                # a stub of the shim used as a value (a regex, a dict, ...) on the way
                stub_seen = "<class 'transformer_engine." in (child.text or "")
                break
            if child.tag == "skipped":
                outcome = "skipped"
                message = child.get("message") or ""
        tests.append(
            {
                "id": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "message": (message.splitlines() or [""])[0].strip(),
                "where": where,
                "stub_seen": stub_seen,
            }
        )
    return tests


#: First lines that are the shim's artefacts although raised outside it: TE's quantized-tensor
#: internals asked of the plain tensor a quantizer stand-in gives back, TE modules' quantizer
#: objects (te_compile keeps FP8 state in its own objects).
SHIM_MESSAGES = (
    "'Tensor' object has no attribute '_",
    "object has no attribute 'quantizers'",
)


def classify(message: str, where: str = "", stub_seen: bool = False) -> str:
    """ "limit", "shim" (ShimMissing, a stub, or raised in the shim's conftest / package) or
    "te_compile"."""
    if "ShimTimeout" in message or "MemoryError" in message or "per-test alarm" in message:
        return "limit"
    if "ShimMissing" in message or "shim:" in message or "_StubMeta" in message:
        return "shim"
    if "(kept by shim_build)" in message:
        return "te_compile"
    if Path(where).name == "conftest.py" or "transformer_engine/" in where:
        return "shim"
    if stub_seen or any(m in message for m in SHIM_MESSAGES):
        return "shim"
    return "te_compile"


def _rate(num: int, den: int) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def summarise(results: list[dict], meta: dict) -> str:
    lines = [
        "# Transformer Engine's PyTorch tests against te_compile (CPU)",
        "",
        f"TE commit `{meta['te_commit']}`, te_compile `{meta['te_compile_commit']}`, "
        f"torch {meta['torch']}, Python {meta['python']}, {meta['date']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Pass rate: passed / (passed + failed). Without shim: the failures whose cause is the "
        "shim (a TE internal te_compile lacks, a stand-in of the shim's) or a limit of the "
        "machine (per-test alarm, memory) set aside. A test that errors in setup counts as "
        "failed. Est. whole file: the sample's counts times the stride.",
        "",
        "| file | collected | sampled (1 in N) | passed | failed | skipped | shim / limit "
        "failures | pass rate | without shim | est. passed / failed, whole file | time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    tot = collections.Counter()
    causes: dict[str, dict] = {}
    for r in results:
        c = collections.Counter(t["outcome"] for t in r["tests"])
        shim = limit = 0
        for t in r["tests"]:
            if t["outcome"] != "failed":
                continue
            kind = classify(t["message"], t.get("where", ""), t.get("stub_seen", False))
            shim += kind == "shim"
            limit += kind == "limit"
            key = t["message"][:140] or "(no message)"
            entry = causes.setdefault(key, {"n": 0, "files": set(), "kind": kind})
            entry["n"] += 1
            entry["files"].add(r["file"].removeprefix("test_").removesuffix(".py"))
        p, f, s = c["passed"], c["failed"], c["skipped"]
        n = r["stride"]
        note = "" if r["rc"] in (0, 1) else f" (pytest rc {r['rc']})"
        lines.append(
            f"| `{r['file']}`{note} | {r.get('collected', '?'):,} | {r.get('sampled', '?')} "
            f"(1 in {n}) | {p} | {f} | {s} | {shim} / {limit} | {_rate(p, p + f)} | "
            f"{_rate(p, p + f - shim - limit)} | {p * n:,} / {f * n:,} | "
            f"{r['seconds']:.0f} s |"
            if isinstance(r.get("collected"), int)
            else f"| `{r['file']}`{note} | ? | ? (1 in {n}) | {p} | {f} | {s} | {shim} / "
            f"{limit} | {_rate(p, p + f)} | {_rate(p, p + f - shim - limit)} | - | "
            f"{r['seconds']:.0f} s |"
        )
        tot.update(passed=p, failed=f, skipped=s, shim=shim, limit=limit, est_p=p * n, est_f=f * n)
        tot["collected"] += r.get("collected", 0) or 0
        tot["seconds"] += r["seconds"]
    p, f = tot["passed"], tot["failed"]
    est = _rate(tot["est_p"], tot["est_p"] + tot["est_f"])
    lines.append(
        f"| all | {tot['collected']:,} | | {p} | {f} | {tot['skipped']} | {tot['shim']} / "
        f"{tot['limit']} | {_rate(p, p + f)} | {_rate(p, p + f - tot['shim'] - tot['limit'])} "
        f"| {tot['est_p']:,} / {tot['est_f']:,} = {est}"
        f" | {tot['seconds']:.0f} s |"
    )
    by_kind = collections.Counter()
    for e in causes.values():
        by_kind[e["kind"]] += e["n"]
    lines += [
        "",
        f"Failure causes (first line of the exception, 140 characters): te_compile "
        f"{by_kind['te_compile']}, shim {by_kind['shim']}, limit {by_kind['limit']}.",
        "",
        "| cause | failures | files | class |",
        "| --- | ---: | --- | --- |",
    ]
    label = {
        "shim": "shim: TE internal",
        "limit": "limit (time, memory)",
        "te_compile": "te_compile",
    }
    for key, e in sorted(causes.items(), key=lambda kv: (-kv[1]["n"], kv[0])):
        cause = key.replace("|", "\\|").replace("`", "'")
        lines.append(
            f"| `{cause}` | {e['n']} | {', '.join(sorted(e['files']))} | {label[e['kind']]} |"
        )
    for r in results:
        if "tail" in r:
            lines += ["", f"`{r['file']}` left no JUnit XML (rc {r['rc']}); output tail:", ""]
            lines += ["```", r["tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    specs = []
    for spec in args.files:
        name, _, stride = spec.partition(":")
        specs.append((name, int(stride or 1)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="te-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    test_dir = extract(args.mirror, args.commit, work)
    patch(test_dir)
    import torch

    meta = {
        "te_commit": (work / "TE_COMMIT").read_text().strip(),
        "te_compile_commit": subprocess.run(
            ["git", "-C", args.te_compile, "rev-parse", "--short=7", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        or "?",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.te_tests.run " + " ".join(f"{n}:{s}" for n, s in specs),
    }
    results = []
    for name, stride in specs:
        print(f"[te_tests] {name} 1 in {stride} ...", file=sys.stderr, flush=True)
        r = run_file(test_dir, name, stride, args, work / f"{name}.xml")
        c = collections.Counter(t["outcome"] for t in r["tests"])
        print(
            f"[te_tests] {name}: {dict(c)} of {r.get('sampled', '?')} sampled "
            f"({r.get('collected', '?')} collected), {r['seconds']:.0f} s, rc {r['rc']}",
            file=sys.stderr,
            flush=True,
        )
        results.append(r)
    text = summarise(results, meta)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
