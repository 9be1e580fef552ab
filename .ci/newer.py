"""Print which pinned packages have a newer release that an unpinned install would take.

Reads pip's ``--dry-run --report`` JSON (argv[1]) and the pins (argv[2]); never fails CI:
it only tells, so a release elsewhere is learnt about without turning main red.
"""

import json
import sys


def main() -> None:
    report = json.load(open(sys.argv[1]))
    pins = {}
    for line in open(sys.argv[2]):
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.lower().replace("_", "-")] = version
    newer = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name = str(meta.get("name", "")).lower().replace("_", "-")
        version = str(meta.get("version", ""))
        if name in pins and version and version.split("+")[0] != pins[name]:
            newer.append(f"{name} {pins[name]} -> {version}")
    if newer:
        print("newer releases than .ci/constraints.txt (not gating; try them: bash .ci/refresh-pins):")
        print("  " + "\n  ".join(newer))
    else:
        print("the pins are the newest releases")


if __name__ == "__main__":
    main()
