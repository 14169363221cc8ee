#!/usr/bin/env python3
"""Print the page-mapping figure used in EXPLAINER.md.

It shows, for one LMCache chunk of a sub-paged full-attention group, which
kernel pages vLLM uses, which pages pristine LMCache 0.5.3 moves, and where
the patched transfer puts every page inside the host object (pass-major).

    python -m lab.page_map_figure --k 4 --store-ids 5 9 --retrieve-ids 2 7
"""

from __future__ import annotations

import argparse


def kernel_pages(logical_id: int, k: int) -> list[int]:
    """vLLM's map_to_kernel_blocks: logical block L is pages L*k .. L*k+k-1."""
    return [logical_id * k + j for j in range(k)]


def figure(k: int, store_ids: list[int], retrieve_ids: list[int]) -> str:
    out: list[str] = []
    w = len(str(max(store_ids + retrieve_ids) * k + k))

    def pages(ps: list[int]) -> str:
        return " ".join(f"p{p:<{w}}" for p in ps)

    out.append(f"k = {k} kernel pages per logical block; one chunk = logical blocks {store_ids}")
    out.append("")
    out.append("vLLM paged FA tensor (what the model reads and writes):")
    for lid in store_ids:
        out.append(f"  logical block {lid:>3} -> kernel pages {pages(kernel_pages(lid, k))}")
    out.append("")
    out.append("pristine 0.5.3 store: one page per logical block, page L (not L*k+j):")
    owners = [f"p{lid} (belongs to logical block {lid // k}, page {lid % k})" for lid in store_ids]
    out.append("  host object FA segment: | " + " | ".join(owners) + " |   = 1/k of the bytes")
    out.append("")
    out.append("patched store: k passes; pass j moves page L*k+j of every block into image j:")
    cells = []
    for j in range(k):
        cells.append(f"img{j}: " + " ".join(f"p{lid * k + j}" for lid in store_ids))
    out.append("  host object FA segment: | " + " | ".join(cells) + " |")
    out.append("  (this pass-major order is the disk tier's byte format)")
    out.append("")
    out.append(f"patched retrieve into logical blocks {retrieve_ids}:")
    for j in range(k):
        dst = " ".join(f"p{lid * k + j}" for lid in retrieve_ids)
        out.append(f"  img{j} -> kernel pages {dst}")
    out.append("")
    out.append(f"pristine retrieve into logical blocks {retrieve_ids}: writes kernel pages "
               + ", ".join(f"p{lid} (block {lid // k}'s page {lid % k})" for lid in retrieve_ids)
               + " -- foreign blocks")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--store-ids", type=int, nargs="+", default=[5, 9])
    ap.add_argument("--retrieve-ids", type=int, nargs="+", default=[2, 7])
    args = ap.parse_args()
    if len(args.store_ids) != len(args.retrieve_ids):
        raise SystemExit("page_map_figure: --store-ids and --retrieve-ids need the same length")
    print(figure(args.k, args.store_ids, args.retrieve_ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
