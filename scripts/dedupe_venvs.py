"""Hard-links files that two virtual environments hold byte for byte the same.

    python3 scripts/dedupe_venvs.py VENV_A VENV_B

vLLM's wheel and vLLM's CPU build each pull torch's CUDA libraries from PyPI (`nvidia-*`
packages, ~3 GB an environment), most of them at the same versions: the second copy of each
identical file becomes a hard link to the first, which saves ~2 GB of disk. pip replaces a file by
unlinking it, so a later install in either environment leaves the other intact. Prints what it
saved; does nothing where the two lie on different file systems.
"""

import filecmp
import os
import sys

MIN_SIZE = 1 << 20


def site_packages(venv):
    lib = os.path.join(venv, "lib")
    for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
        path = os.path.join(lib, name, "site-packages")
        if os.path.isdir(path):
            return path
    return None


def main(a, b):
    root_a, root_b = site_packages(a), site_packages(b)
    if not root_a or not root_b:
        print(f"dedupe: no site-packages in {a} or {b}; nothing done", file=sys.stderr)
        return 0
    if os.stat(root_a).st_dev != os.stat(root_b).st_dev:
        print("dedupe: the environments are on different file systems; nothing done", file=sys.stderr)
        return 0
    saved = linked = 0
    for dirpath, _, files in os.walk(root_b):
        for name in files:
            path_b = os.path.join(dirpath, name)
            path_a = os.path.join(root_a, os.path.relpath(path_b, root_b))
            try:
                st_b, st_a = os.lstat(path_b), os.lstat(path_a)
            except FileNotFoundError:
                continue
            if not (os.path.isfile(path_b) and not os.path.islink(path_b) and os.path.isfile(path_a)):
                continue
            if st_b.st_size < MIN_SIZE or st_b.st_size != st_a.st_size or st_b.st_ino == st_a.st_ino:
                continue
            if not filecmp.cmp(path_a, path_b, shallow=False):
                continue
            tmp = path_b + ".dedupe-tmp"
            os.link(path_a, tmp)
            os.replace(tmp, path_b)
            saved += st_b.st_size
            linked += 1
    print(f"dedupe: {linked} files shared between {a} and {b}, {saved / 2**30:.1f} GiB saved", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
