#!/usr/bin/env python3
"""Who calls whom among gpumemd's source files, from the objects' own
symbol tables (nm), not from a list kept by hand.

    tools/layers.py [BUILD_DIR [SOURCE_DIR]]   (default build, the tree)

A file calls another when its object uses (nm: U) a symbol the other's
object defines. It reports, and exits 1 on, either of:
  - a cycle among the files of one folder (daemon/, client/, ...): two or
    more files that call each other, directly or around a loop;
  - a call from a lower layer to a higher one. The layers, lowest first:
    gen (protoc-c's code), common, gpu, then client and daemon (neither
    calls the other), then ctl, tools, preload (the programs).
Only objects whose source is still in SOURCE_DIR count (a build keeps the
objects of files since removed). make check runs it on the build, and
tests/build/check_layers.sh on objects with a deliberate back-call too.
Each cycle is printed with the symbols that close it."""
import collections
import os
import subprocess
import sys

LAYERS = {"gen": 0, "common": 1, "gpu": 2, "client": 3, "daemon": 3,
          "ctl": 4, "tools": 4, "preload": 4}


def symbols(obj):
    """The (defined, used) global symbols of an object file."""
    out = subprocess.run(["nm", "--defined-only", "-g", obj], capture_output=True,
                         text=True, check=True).stdout
    defined = {line.split()[-1] for line in out.splitlines() if len(line.split()) == 3}
    out = subprocess.run(["nm", "-u", obj], capture_output=True, text=True, check=True).stdout
    used = {line.split()[-1] for line in out.splitlines() if line.split()}
    return defined, used


def objects(build, src):
    """Source file (daemon/engine.c) -> its object, for every folder above
    (the generated code's objects count whatever the source tree holds)."""
    found = {}
    root = os.path.join(build, "obj")
    for folder in LAYERS:
        d = os.path.join(root, folder)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            source = "%s/%s.c" % (folder, name[:-2])
            if name.endswith(".o") and (folder == "gen" or os.path.exists(os.path.join(src, source))):
                found[source] = os.path.join(d, name)
    return found


def cycles(graph, nodes):
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    src = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..")
    objs = objects(build, src)
    if not objs:
        print("layers: no objects under %s/obj: build first" % build)
        return 2
    defined, used = {}, {}
    for src, obj in objs.items():
        defined[src], used[src] = symbols(obj)
    owner = {}
    for src, syms in defined.items():
        for s in syms:
            owner.setdefault(s, src)
    calls = collections.defaultdict(lambda: collections.defaultdict(set))
    for src, syms in used.items():
        for s in syms:
            other = owner.get(s)
            if other and other != src:
                calls[src][other].add(s)
    problems = 0
    folders = sorted({src.split("/")[0] for src in objs})
    for folder in folders:
        nodes = {src for src in objs if src.startswith(folder + "/")}
        graph = {src: set(calls[src]) for src in nodes}
        for comp in cycles(graph, nodes):
            problems += 1
            print("cycle in %s/: %s" % (folder, " <-> ".join(comp)))
            for a in comp:
                for b in comp:
                    if b in calls[a]:
                        print("  %s calls %s: %s" % (a, b, ", ".join(sorted(calls[a][b])[:4])))
    for src in sorted(calls):
        for other in sorted(calls[src]):
            a, b = src.split("/")[0], other.split("/")[0]
            if a != b and (LAYERS[b] > LAYERS[a] or (LAYERS[a] == LAYERS[b] and a != b)):
                problems += 1
                print("layer: %s (%s) calls %s (%s): %s" % (
                    src, a, other, b, ", ".join(sorted(calls[src][other])[:4])))
    if problems:
        print("layers: %d problems among %d files" % (problems, len(objs)))
        return 1
    print("layers: no cycle within a folder and no call upwards among %d files" % len(objs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
