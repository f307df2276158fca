"""A throw-away docker-registry on 127.0.0.1 (tests/tools/registry.sh) and
the reference images benchmarks convert into it."""

from pathlib import Path

from .core import ROOT, log, run

DEBIAN_LAYOUT = Path("/var/cache/lamina-test/debian-oci")
DEBIAN_TAG = "bookworm"


class Registry:
    """Started on construction (inside network namespace `netns` when
    given: it and its clients then talk across that namespace's lo); its
    data stays in DIR/data after `stop`."""

    def __init__(self, directory, netns=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.script = ROOT / "tests" / "tools" / "registry.sh"
        self.port = run(["bash", self.script, "start", self.dir], timeout=60, netns=netns).stdout.strip()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self):
        return int((self.dir / "pid").read_text())

    @property
    def data(self):
        return self.dir / "data"

    def ref(self, repo_tag):
        return f"docker://127.0.0.1:{self.port}/{repo_tag}"

    def stop(self):
        run(["bash", self.script, "stop", self.dir], timeout=60, check=False)


def debian_layout():
    """The reference Debian image as an OCI layout (built once per machine
    by scripts/debian-image.sh); its `oci:` reference."""
    run(["bash", ROOT / "scripts" / "debian-image.sh", DEBIAN_LAYOUT], timeout=1800)
    log(f"reference image: {DEBIAN_LAYOUT}:{DEBIAN_TAG}")
    return f"oci:{DEBIAN_LAYOUT}:{DEBIAN_TAG}"
