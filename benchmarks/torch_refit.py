#!/usr/bin/env python3
"""A weight refit written with torch.distributed, as an external baseline for refit.

Reads a pair of refit layout files (docs/layout-format.md), starts one process
per rank (source ranks first, then destination ranks; gloo on CPU, nccl when
CUDA is present), gives every process only its own rank's blocks, in its
layout's buffers and dtypes, and times refits written the way RL frameworks
write them:

  gather-broadcast  per bucket of whole tensors (~256 MiB): gather every tensor
                    onto training rank 0 (point-to-point from the holders),
                    convert to the destination dtype, dist.broadcast the bucket
                    from training rank 0 to every inference rank (one process
                    group: training rank 0 + all inference ranks); each
                    inference rank slices its blocks out of it.
  p2p               for every destination block, intersect it with the source
                    blocks (one holder per region, the least loaded),
                    isend/irecv exactly the intersecting boxes (contiguous
                    copies), convert the dtype on arrival.

Every refit: barrier, then the time until the last destination has copied its
data into its buffers. Destinations are overwritten with 0xff bytes (NaN for
floats) before every refit; after the last timed refit every destination
element is checked against the source pattern converted with torch's rounding
(not timed). Output: one JSON line per variant on stdout, a summary on stderr.

    python3 benchmarks/torch_refit.py --src S.json --dst D.json [--refits 5]
        [--variant both|gather-broadcast|p2p] [--bucket-mib 256] [--plan-only]
    python3 benchmarks/torch_refit.py --compare --src S.json --dst D.json
        [--refits 3] [--rounds 3] [--refit-bin target/release/refit] [--old-refit-bin PATH]

Without torch installed it prints "torch not installed: skipped (pip install
torch)" and exits 0 (--plan-only and the layout parser need no torch).
The nccl path (CUDA present) is kept simple and has not been tested.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import warnings
import zlib

# torch warns at import when numpy is absent; nothing here needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

SKIP = "torch not installed: skipped (pip install torch)"
SIZES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "f8e4m3": 1, "f8e5m2": 1, "i64": 8, "i32": 4, "i8": 1, "u8": 1}
FLOATS = {"f64", "f32", "bf16", "f16"}
TOP_FIELDS = {"ranks", "ranks_per_node", "tensors"}
TENSOR_FIELDS = {"name", "dtype", "shape", "mesh", "placements", "shards", "buffer", "at"}
MESH_FIELDS = {"shape", "ranks"}
SHARD_FIELDS = {"rank", "offset", "extent", "flat", "buffer", "at"}
MIB = 1 << 20


class LayoutError(Exception):
    pass


# ---------------------------------------------------------------- boxes ----
# A box is (offset, extent), two tuples of ints, one entry per tensor dim.


def numel(ext):
    n = 1
    for e in ext:
        n *= e
    return n


def intersect(a, b):
    off, ext = [], []
    for ao, ae, bo, be in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + ae, bo + be)
        if hi <= lo:
            return None
        off.append(lo)
        ext.append(hi - lo)
    return tuple(off), tuple(ext)


def subtract(a, c):
    """a minus c (c inside a): disjoint boxes covering the rest of a."""
    out = []
    off, ext = list(a[0]), list(a[1])
    for d in range(len(off)):
        lo, hi = off[d], off[d] + ext[d]
        clo, chi = c[0][d], c[0][d] + c[1][d]
        if clo > lo:
            o, e = off.copy(), ext.copy()
            o[d], e[d] = lo, clo - lo
            out.append((tuple(o), tuple(e)))
        if chi < hi:
            o, e = off.copy(), ext.copy()
            o[d], e[d] = chi, hi - chi
            out.append((tuple(o), tuple(e)))
        off[d], ext[d] = clo, chi - clo
    return out


def chunk_range(n, k, i):
    """torch.chunk: chunk i of n split in k, with chunk size ceil(n / k)."""
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def flat_boxes(shape, start, length):
    """Elements start..start+length of the row-major flattened tensor as
    boxes in flat order (as reshard::flat_blocks)."""
    out = []
    nd = len(shape)

    def make(prefix, dim, lo, hi):
        off = list(prefix) + ([lo] + [0] * (nd - dim - 1) if dim < nd else [])
        ext = [1] * len(prefix) + ([hi - lo] + list(shape[dim + 1:]) if dim < nd else [])
        return tuple(off), tuple(ext)

    def rec(dim, s, e, prefix):
        if s >= e:
            return
        if dim == nd:
            out.append(make(prefix, dim, 0, 0))
            return
        inner = numel(shape[dim + 1:])
        if inner == 0:
            return
        rs, re_ = s // inner, e // inner
        if rs == re_:
            rec(dim + 1, s - rs * inner, e - rs * inner, prefix + [rs])
            return
        row = rs
        if s % inner:
            rec(dim + 1, s % inner, inner, prefix + [rs])
            row += 1
        if re_ > row:
            out.append(make(prefix, dim, row, re_))
        if e % inner:
            rec(dim + 1, 0, e % inner, prefix + [re_])

    if length > 0:
        rec(0, start, start + length, [])
    return out


# --------------------------------------------------------------- layout ----


class Tensor:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        # box -> list of (rank, buffer key, at); boxes in first-seen order
        self.holdings = {}

    def hold(self, box, rank, key, at):
        if numel(box[1]) == 0:
            return
        self.holdings.setdefault(box, []).append((rank, key, at))


class Layout:
    def __init__(self, path):
        self.path = path
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise LayoutError(f"{path}: {e}")
        self._fields(doc, TOP_FIELDS, "")
        self.ranks = self._int(doc, "ranks", "ranks")
        self.tensors = {}
        for i, t in enumerate(self._get(doc, "tensors", "tensors", list)):
            name = t.get("name") if isinstance(t, dict) else None
            where = f"tensors[{i}] ({name!r})"
            if not isinstance(t, dict):
                raise LayoutError(f"{path}: {where}: expected an object")
            self._fields(t, TENSOR_FIELDS, where + ".")
            name = self._get(t, "name", where + ".name", str)
            if name in self.tensors:
                raise LayoutError(f"{path}: {where}.name: duplicate tensor name {name!r}")
            dtype = self._get(t, "dtype", where + ".dtype", str)
            if dtype not in SIZES:
                raise LayoutError(f"{path}: {where}.dtype: unsupported dtype {dtype!r} (supported: {' '.join(SIZES)})")
            shape = [self._nonneg(x, f"{where}.shape[{j}]") for j, x in enumerate(self._get(t, "shape", where + ".shape", list))]
            tensor = Tensor(name, dtype, shape)
            if "shards" in t:
                for k in ("mesh", "placements", "buffer", "at"):
                    if k in t:
                        raise LayoutError(f"{path}: {where}.{k}: not allowed together with 'shards'")
                for j, s in enumerate(self._get(t, "shards", where + ".shards", list)):
                    self._shard(tensor, j, s, f"{where}.shards[{j}]")
            elif "mesh" in t and "placements" in t:
                self._mesh(tensor, t, where)
            else:
                raise LayoutError(f"{path}: {where}: needs 'mesh' + 'placements' or 'shards'")
            self.tensors[name] = tensor

    # -- parsing helpers
    def _fields(self, obj, allowed, where):
        if not isinstance(obj, dict):
            raise LayoutError(f"{self.path}: {where or 'top level'}: expected an object")
        for k in obj:
            if k not in allowed:
                raise LayoutError(
                    f"{self.path}: {where}{k}: unsupported field {k!r} (this script reads: {', '.join(sorted(allowed))})"
                )

    def _get(self, obj, key, where, typ):
        if key not in obj:
            raise LayoutError(f"{self.path}: {where}: missing field")
        v = obj[key]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise LayoutError(f"{self.path}: {where}: expected {typ.__name__}, got {v!r}")
        return v

    def _nonneg(self, v, where):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise LayoutError(f"{self.path}: {where}: expected a non-negative integer, got {v!r}")
        return v

    def _int(self, obj, key, where):
        return self._nonneg(self._get(obj, key, where, int), where)

    def _rank(self, v, where):
        r = self._nonneg(v, where)
        if r >= self.ranks:
            raise LayoutError(f"{self.path}: {where}: rank {r} >= ranks ({self.ranks})")
        return r

    def _storage(self, obj, where, default_key):
        if "buffer" in obj:
            b = self._get(obj, "buffer", where + ".buffer", str)
            if not b:
                raise LayoutError(f"{self.path}: {where}.buffer: buffer name must not be empty")
            return ("named", b), self._nonneg(obj.get("at", 0), where + ".at")
        if "at" in obj:
            raise LayoutError(f"{self.path}: {where}.at: given without 'buffer'")
        return default_key, 0

    def _shard(self, tensor, j, s, where):
        self._fields(s, SHARD_FIELDS, where + ".")
        rank = self._rank(s.get("rank"), where + ".rank")
        key, at = self._storage(s, where, ("own", tensor.name, j))
        nd = len(tensor.shape)
        if "flat" in s:
            if "offset" in s or "extent" in s:
                raise LayoutError(f"{self.path}: {where}: has both 'offset'/'extent' and 'flat'")
            fl = self._get(s, "flat", where + ".flat", list)
            if len(fl) != 2:
                raise LayoutError(f"{self.path}: {where}.flat: expected [start, len], got {len(fl)} numbers")
            start, length = (self._nonneg(x, where + ".flat") for x in fl)
            if start + length > numel(tensor.shape):
                raise LayoutError(f"{self.path}: {where}: flat {start}..{start + length} is outside 0..{numel(tensor.shape)}")
            pos = at
            for box in flat_boxes(tensor.shape, start, length):
                tensor.hold(box, rank, key, pos)
                pos += numel(box[1])
        elif "offset" in s and "extent" in s:
            off = [self._nonneg(x, where + ".offset") for x in self._get(s, "offset", where + ".offset", list)]
            ext = [self._nonneg(x, where + ".extent") for x in self._get(s, "extent", where + ".extent", list)]
            if len(off) != nd or len(ext) != nd:
                raise LayoutError(f"{self.path}: {where}: offset has {len(off)} and extent {len(ext)} dims, tensor has {nd}")
            for d in range(nd):
                if off[d] + ext[d] > tensor.shape[d]:
                    raise LayoutError(f"{self.path}: {where}: dim {d}: {off[d]}..{off[d] + ext[d]} is outside 0..{tensor.shape[d]}")
            tensor.hold((tuple(off), tuple(ext)), rank, key, at)
        else:
            raise LayoutError(f"{self.path}: {where}: needs 'offset'+'extent' or 'flat'")

    def _mesh(self, tensor, t, where):
        m = t["mesh"]
        self._fields(m, MESH_FIELDS, where + ".mesh.")
        mshape = [self._nonneg(x, where + ".mesh.shape") for x in self._get(m, "shape", where + ".mesh.shape", list)]
        if not mshape or 0 in mshape:
            raise LayoutError(f"{self.path}: {where}.mesh.shape: needs at least one dimension, none of them 0")
        size = numel(mshape)
        ranks = m.get("ranks")
        ranks = list(range(size)) if ranks is None else [self._rank(r, where + ".mesh.ranks") for r in ranks]
        if len(ranks) != size or len(set(ranks)) != size:
            raise LayoutError(f"{self.path}: {where}.mesh.ranks: needs {size} distinct ranks")
        placements = self._get(t, "placements", where + ".placements", list)
        if len(placements) != len(mshape):
            raise LayoutError(f"{self.path}: {where}.placements: {len(placements)} placements for a {len(mshape)}-d mesh")
        dims = []
        for j, p in enumerate(placements):
            p = re.sub(r"\s+", "", p) if isinstance(p, str) else p
            mt = re.fullmatch(r"shard\((\d+)\)", p) if isinstance(p, str) else None
            if p == "replicate":
                dims.append(None)
            elif mt and int(mt.group(1)) < len(tensor.shape):
                dims.append(int(mt.group(1)))
            else:
                raise LayoutError(f"{self.path}: {where}.placements[{j}]: unsupported placement {p!r} (replicate or shard(d), d < {len(tensor.shape)})")
        key, at = self._storage(t, where, ("own", tensor.name, 0))
        for pos, rank in enumerate(ranks):
            coord, rest = [0] * len(mshape), pos
            for i in reversed(range(len(mshape))):  # row-major
                coord[i], rest = rest % mshape[i], rest // mshape[i]
            off, ext = [0] * len(tensor.shape), list(tensor.shape)
            for i, d in enumerate(dims):  # lower mesh dims split first
                if d is None:
                    continue
                lo, hi = chunk_range(ext[d], mshape[i], coord[i])
                off[d] += lo
                ext[d] = hi - lo
            tensor.hold((tuple(off), tuple(ext)), rank, key, at)

    # -- per rank
    def rank_holdings(self, rank):
        """[(tensor, box, key, at)] of one rank."""
        out = []
        for t in self.tensors.values():
            for box, holders in t.holdings.items():
                out.extend((t, box, key, at) for (r, key, at) in holders if r == rank)
        return out

    def rank_buffers(self, rank):
        """{key: (dtype, elements)} of one rank."""
        bufs = {}
        for t, box, key, at in self.rank_holdings(rank):
            end = at + numel(box[1])
            dt, n = bufs.get(key, (t.dtype, 0))
            if dt != t.dtype:
                raise LayoutError(f"{self.path}: rank {rank}: buffer {key[1]!r} holds {dt} and {t.dtype}; one buffer has one dtype")
            bufs[key] = (dt, max(n, end))
        return bufs


# ----------------------------------------------------------------- plans ----


def check_pair(src, dst):
    for t in dst.tensors.values():
        s = src.tensors.get(t.name)
        if s is None:
            raise LayoutError(f"{src.path} -> {dst.path}: destination tensor {t.name!r} is absent from the source layout")
        if s.shape != t.shape:
            raise LayoutError(f"{src.path} -> {dst.path}: tensor {t.name!r}: source shape {list(s.shape)} differs from destination shape {list(t.shape)}")
        if s.dtype != t.dtype and not (s.dtype in FLOATS and t.dtype in FLOATS):
            raise LayoutError(f"{src.path} -> {dst.path}: tensor {t.name!r}: cannot convert {s.dtype} to {t.dtype}")


def cover(src_tensor, box, pick, what):
    """Pieces of `box` from the source holdings: [(piece, src rank, src box, key, at)];
    `pick(holders, piece)` chooses one holder per piece."""
    out, rest = [], [box]
    for sbox, holders in src_tensor.holdings.items():
        nxt = []
        for piece in rest:
            inter = intersect(piece, sbox)
            if inter is None:
                nxt.append(piece)
                continue
            rank, key, at = pick(holders, inter)
            out.append((inter, rank, sbox, key, at))
            nxt.extend(subtract(piece, inter))
        rest = nxt
        if not rest:
            break
    if rest:
        raise LayoutError(f"tensor {src_tensor.name!r}: region {rest[0]} needed by {what} is not covered by any source shard")
    return out


def plan_p2p(src, dst):
    """[(tensor name, region, src rank, (src box, key, at), dst rank, (dst box, key, at))],
    in a deterministic order; the least loaded holder sends each region."""
    sent = [0] * src.ranks

    def pick(holders, piece):
        h = min(holders, key=lambda h: (sent[h[0]], h[0]))
        sent[h[0]] += numel(piece[1])
        return h

    moves = []
    for t in dst.tensors.values():
        s = src.tensors[t.name]
        for dbox, holders in t.holdings.items():
            for drank, dkey, dat in holders:
                for region, srank, sbox, skey, sat in cover(s, dbox, pick, f"dst rank {drank}"):
                    moves.append((t.name, region, srank, (sbox, skey, sat), drank, (dbox, dkey, dat)))
    return moves


def plan_gather_broadcast(src, dst, bucket_bytes):
    """Buckets of whole tensors: [{"tensors": [(name, byte offset, nbytes)], "nbytes": n,
    "pieces": [(name, region, src rank, (src box, key, at))]}]; every region
    comes from source rank 0 where it holds it, else from the lowest holder."""

    def pick(holders, piece):
        return min(holders, key=lambda h: (h[0] != 0, h[0]))

    buckets, cur = [], None
    for t in dst.tensors.values():
        if not t.holdings:
            continue  # no destination rank holds any of it
        s = src.tensors[t.name]
        nbytes = numel(t.shape) * SIZES[t.dtype]
        if cur is None or (cur["nbytes"] and cur["nbytes"] + nbytes > bucket_bytes):
            cur = {"tensors": [], "nbytes": 0, "pieces": []}
            buckets.append(cur)
        full = ((0,) * len(t.shape), t.shape)
        for region, srank, sbox, skey, sat in cover(s, full, pick, "the gather"):
            cur["pieces"].append((t.name, region, srank, (sbox, skey, sat)))
        off = -(-cur["nbytes"] // 8) * 8  # 8-byte aligned, for the views
        cur["tensors"].append((t.name, off, nbytes))
        cur["nbytes"] = off + nbytes
    return buckets


def bytes_p2p(src, moves):
    return sum(numel(m[1][1]) * SIZES[src.tensors[m[0]].dtype] for m in moves)


def bytes_gather_broadcast(src, dst, buckets):
    gathered = sum(numel(p[1][1]) * SIZES[src.tensors[p[0]].dtype] for b in buckets for p in b["pieces"] if p[2] != 0)
    return gathered + sum(b["nbytes"] for b in buckets) * dst.ranks


# ---------------------------------------------------------------- worker ----


def torch_dtype(torch, name):
    return {
        "f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
        "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2,
        "i64": torch.int64, "i32": torch.int32, "i8": torch.int8, "u8": torch.uint8,
    }[name]


CHUNK = 1 << 22  # elements per pattern chunk


def box_rows(box):
    """Row ranges (along dim 0 of the box) of at most ~CHUNK elements."""
    off, ext = box
    if not ext:
        yield 0, 1
        return
    per_row = max(1, numel(ext[1:]))
    step = max(1, CHUNK // per_row)
    for lo in range(0, ext[0], step):
        yield lo, min(ext[0], lo + step)


def pattern(torch, tensor, box, lo, hi, device):
    """Source values (in the source dtype) of rows lo..hi of `box` of `tensor`."""
    shape, (off, ext) = tensor.shape, box
    nd = len(shape)
    if nd == 0:
        idx = torch.zeros(1, dtype=torch.int64, device=device)
    else:
        stride = [numel(shape[d + 1:]) for d in range(nd)]
        idx = torch.zeros([hi - lo] + list(ext[1:]), dtype=torch.int64, device=device)
        for d in range(nd):
            a, b = (off[0] + lo, off[0] + hi) if d == 0 else (off[d], off[d] + ext[d])
            r = torch.arange(a, b, dtype=torch.int64, device=device) * stride[d]
            idx += r.view([-1 if i == d else 1 for i in range(nd)])
    tid = zlib.crc32(tensor.name.encode()) % 10007
    h = (idx * 40503 + tid * 7919) % 65521
    dt = torch_dtype(torch, tensor.dtype)
    if tensor.dtype in FLOATS:
        return (h.to(torch.float64) / 64 - 512).to(dt)
    if tensor.dtype.startswith("f8"):
        return ((h % 64 - 32).to(torch.float32) / 4).to(dt)
    return (h % 97 + 1).to(dt)  # never 0xff.. (the destination sentinel)


def flat_bytes(x):
    """The bytes of a contiguous tensor, as a flat uint8 view (what travels)."""
    import torch

    return x.reshape(-1).view(torch.uint8)


class Rank:
    """One process: its group, rank, buffers and the plans."""

    def __init__(self, torch, dist, args, src, dst, grank, device):
        self.torch, self.dist, self.args = torch, dist, args
        self.src, self.dst, self.device = src, dst, device
        self.grank = grank
        self.is_src = grank < src.ranks
        self.layout = src if self.is_src else dst
        self.rank = grank if self.is_src else grank - src.ranks
        self.buffers = {
            key: torch.empty(n, dtype=torch_dtype(torch, dt), device=device)
            for key, (dt, n) in self.layout.rank_buffers(self.rank).items()
        }
        self.holdings = self.layout.rank_holdings(self.rank)
        if self.is_src:
            for t, box, key, at in self.holdings:
                view = self.view(key, at, box)
                for lo, hi in box_rows(box):
                    view[lo:hi] = pattern(torch, t, box, lo, hi, device)

    def view(self, key, at, box):
        """A block where it is stored: shape box extent ([1] for a scalar)."""
        return self.buffers[key][at:at + numel(box[1])].view(list(box[1]) or [1])

    @staticmethod
    def slices(inner, outer):
        """Index of box `inner` within a view of box `outer` (shape [1] for a scalar)."""
        if not inner[1]:
            return (slice(0, 1),)
        return tuple(slice(io - oo, io - oo + ie) for io, ie, oo in zip(inner[0], inner[1], outer[0]))

    def sentinel(self):
        if not self.is_src:
            for b in self.buffers.values():
                flat_bytes(b).fill_(255)

    # -- the two refits
    def p2p(self, moves):
        torch, dist = self.torch, self.dist
        works, arrivals, tags = [], [], {}
        for name, region, srank, (sbox, skey, sat), drank, (dbox, dkey, dat) in moves:
            pair = (srank, drank)
            tag = tags[pair] = tags.get(pair, -1) + 1
            if self.is_src and srank == self.rank:
                data = self.view(skey, sat, sbox)[self.slices(region, sbox)].contiguous()
                works.append(dist.isend(flat_bytes(data), self.src.ranks + drank, tag=tag))
            elif not self.is_src and drank == self.rank:
                sdt = torch_dtype(torch, self.src.tensors[name].dtype)
                tmp = torch.empty(max(1, numel(region[1])), dtype=sdt, device=self.device)
                w = dist.irecv(flat_bytes(tmp), srank, tag=tag)
                arrivals.append((w, tmp, region, dbox, dkey, dat))
        for w, tmp, region, dbox, dkey, dat in arrivals:  # convert on arrival
            w.wait()
            self.view(dkey, dat, dbox)[self.slices(region, dbox)].copy_(tmp.view(list(region[1]) or [1]))
        for w in works:
            w.wait()

    def gather_broadcast(self, buckets, group):
        torch, dist = self.torch, self.dist
        bcast_root = 0
        self.gather_s = 0.0  # training rank 0: gathering and converting (the rest is the broadcast)
        for b in buckets:
            t = time.perf_counter()
            bucket = None
            if self.grank == 0 or not self.is_src:
                bucket = torch.empty(b["nbytes"], dtype=torch.uint8, device=self.device)
            if self.is_src:
                # gather whole tensors on training rank 0
                works, got, tags = [], [], {}
                for name, region, srank, (sbox, skey, sat) in b["pieces"]:
                    tag = tags[srank] = tags.get(srank, -1) + 1
                    if srank == self.rank and self.rank != 0:
                        data = self.view(skey, sat, sbox)[self.slices(region, sbox)].contiguous()
                        works.append(dist.isend(flat_bytes(data), 0, tag=tag))
                    elif self.rank == 0 and srank != 0:
                        sdt = torch_dtype(torch, self.src.tensors[name].dtype)
                        tmp = torch.empty(max(1, numel(region[1])), dtype=sdt, device=self.device)
                        got.append((dist.irecv(flat_bytes(tmp), srank, tag=tag), name, region, tmp))
                    elif self.rank == 0:
                        got.append((None, name, region, self.view(skey, sat, sbox)[self.slices(region, sbox)]))
                if self.rank == 0:
                    full = {}
                    for name, _, _ in b["tensors"]:
                        s = self.src.tensors[name]
                        full[name] = torch.empty(list(s.shape) or [1], dtype=torch_dtype(torch, s.dtype), device=self.device)
                    for w, name, region, tmp in got:
                        if w is not None:
                            w.wait()
                        whole = ((0,) * len(region[0]), None)
                        full[name][self.slices(region, whole)].copy_(tmp.reshape(list(region[1]) or [1]))
                    for name, off, nbytes in b["tensors"]:  # convert to the destination dtype
                        ddt = torch_dtype(torch, self.dst.tensors[name].dtype)
                        bucket[off:off + nbytes].view(ddt).copy_(full[name].reshape(-1))
                    del full, got
                for w in works:
                    w.wait()
            if self.grank == 0:
                self.gather_s += time.perf_counter() - t
            if bucket is not None:
                dist.broadcast(bucket, bcast_root, group=group)
            if not self.is_src:
                for name, off, nbytes in b["tensors"]:
                    t = self.dst.tensors[name]
                    whole = bucket[off:off + nbytes].view(torch_dtype(torch, t.dtype)).view(list(t.shape) or [1])
                    for box, holders in t.holdings.items():
                        for r, key, at in holders:
                            if r == self.rank:
                                self.view(key, at, box).copy_(whole[self.slices(box, ((0,) * len(box[0]), None))])

    def verify(self):
        """(elements checked, mismatches, first mismatch)."""
        torch = self.torch
        if self.is_src:
            return 0, 0, None
        checked, bad, first = 0, 0, None
        for t, box, key, at in self.holdings:
            s = self.src.tensors[t.name]
            view = self.view(key, at, box)
            for lo, hi in box_rows(box):
                want = pattern(torch, s, box, lo, hi, self.device).to(torch_dtype(torch, t.dtype))
                got = view[lo:hi]
                eq = flat_bytes(got.contiguous()).view(-1, SIZES[t.dtype]) == flat_bytes(want).view(-1, SIZES[t.dtype])
                miss = int((~eq.all(dim=1)).sum())
                checked += want.numel()
                if miss:
                    bad += miss
                    if first is None:
                        first = f"dst rank {self.rank}: tensor {t.name!r} box {box} rows {lo}..{hi}: {miss} elements differ"
        return checked, bad, first


def worker(local, args, port, src_path, dst_path, world, failed):
    import datetime
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    src, dst = Layout(src_path), Layout(dst_path)
    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    device = torch.device(f"cuda:{local % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=local, world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    group = dist.new_group([0] + [src.ranks + r for r in range(dst.ranks)])
    me = Rank(torch, dist, args, src, dst, local, device)
    moves = plan_p2p(src, dst)
    buckets = plan_gather_broadcast(src, dst, args.bucket_mib * MIB)
    variants = ["gather-broadcast", "p2p"] if args.variant == "both" else [args.variant]
    run = {"gather-broadcast": lambda: me.gather_broadcast(buckets, group), "p2p": lambda: me.p2p(moves)}
    times = {v: [] for v in variants}
    gather_times = []

    def one(v):
        me.sentinel()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes of one host
        run[v]()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        both = torch.tensor([t0, t1 if not me.is_src else 0.0, getattr(me, "gather_s", 0.0)], dtype=torch.float64, device=device)
        all_ = [torch.zeros_like(both) for _ in range(world)]
        dist.all_gather(all_, both)
        start = min(float(x[0]) for x in all_)
        end = max(float(x[1]) for x in all_)
        if v == "gather-broadcast":
            gather_times.append(float(all_[0][2]))
        return end - start

    for v in variants:  # one untimed warm-up each (connections, allocator)
        one(v)
    for _ in range(args.refits):  # alternating
        for v in variants:
            times[v].append(one(v))
    results = {}
    for v in variants:  # verify after a last (untimed) refit of each
        one(v)
        checked, bad, first = me.verify()
        if first:
            print(f"torch {v}: MISMATCH at {first}", file=sys.stderr, flush=True)
        c = torch.tensor([checked, bad], dtype=torch.int64, device=device)
        dist.all_reduce(c)
        results[v] = (int(c[0]), int(c[1]), "see the MISMATCH lines above" if int(c[1]) else None)
    if local == 0:
        for v in variants:
            ts = times[v]
            checked, bad, first = results[v]
            nbytes = bytes_p2p(src, moves) if v == "p2p" else bytes_gather_broadcast(src, dst, buckets)
            line = {
                "variant": v, "backend": backend, "refits": len(ts),
                "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                "times_s": [round(t, 6) for t in ts], "bytes_moved": nbytes,
                "verified": bad == 0, "elements_checked": checked,
                "processes": world, "src": src_path, "dst": dst_path,
            }
            if v == "gather-broadcast":
                # training rank 0's gathering + converting; the rest of each refit is the broadcast
                line["gather_median_s"] = statistics.median(gather_times[1:1 + len(ts)])
            if bad:
                line["mismatches"] = bad
                line["first_mismatch"] = first
            print(json.dumps(line), flush=True)
        for v in variants:
            ts = times[v]
            checked, bad, first = results[v]
            nbytes = bytes_p2p(src, moves) if v == "p2p" else bytes_gather_broadcast(src, dst, buckets)
            print(
                f"torch {v:<16} ({backend}, {world} processes): {len(ts)} refits, median {statistics.median(ts):.3f} s "
                f"(min {min(ts):.3f}, max {max(ts):.3f}), {nbytes / MIB:.1f} MiB moved, "
                + (f"gathering on rank 0 {statistics.median(gather_times[1:1 + len(ts)]):.3f} s of it, " if v == "gather-broadcast" else "")
                + (f"verified {checked} destination elements" if not bad else f"FAILED: {bad} elements differ; {first}"),
                file=sys.stderr, flush=True,
            )
    if local == 0 and any(r[1] for r in results.values()):
        failed.value = 1
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------- compare ----


def parse_duration(s):
    s = s.strip()
    m = re.fullmatch(r"([\d.]+) ms", s)
    if m:
        return float(m.group(1)) / 1e3
    m = re.fullmatch(r"([\d.]+) s", s)
    if m:
        return float(m.group(1))
    m = re.fullmatch(r"(\d+)m (\d+)s", s)
    if m:
        return int(m.group(1)) * 60 + int(m.group(2))
    raise ValueError(f"cannot read duration {s!r}")


def run_refit_launch(args, baseline, binary=None):
    """Per-refit times of `refit launch`, K + 1 refits, the first (which plans
    and installs the programs) dropped as the warm-up, as the torch variants
    drop theirs. Two times per refit, read from its human output: the
    orchestrator's wall time of the refit (`ok in X`: status, connecting this
    refit's data plane, moving, committing), and the launcher's whole step
    (`Y with filling the sources`), which is the `ms` of `--json`; the JSON has
    no per-refit wall time, and filling the sources is not part of a refit."""
    cmd = [binary or args.refit_bin, "launch", "--src", args.src, "--dst", args.dst, "--refits", str(args.refits + 1)]
    if baseline:
        cmd.append("--baseline")
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-2000:]}")
    walls, steps = [], []
    for m in re.finditer(r"refit \d+: ok in ([^()]+?) \(([^()]+?) with filling the sources", out):
        walls.append(parse_duration(m.group(1)))
        steps.append(parse_duration(m.group(2)))
    if len(walls) != args.refits + 1:
        raise RuntimeError(f"{' '.join(cmd)}: found {len(walls)} refit lines, expected {args.refits + 1}:\n{out[-2000:]}")
    return walls[1:], steps[1:]


def run_torch(args, variant):
    cmd = [sys.executable, os.path.abspath(__file__), "--src", args.src, "--dst", args.dst,
           "--refits", str(args.refits), "--variant", variant, "--bucket-mib", str(args.bucket_mib)]
    if args.cpu:
        cmd.append("--cpu")
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or len(lines) != 1 or not lines[0]["verified"]:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
    return lines[0]["times_s"], lines[0].get("gather_median_s")


# The row of `--old-refit-bin`: the baseline of another build of refit.
OLD_BASELINE = "old bin launch --baseline"


def compare(args, have_torch):
    if not os.path.exists(args.refit_bin):
        sys.exit(f"error: {args.refit_bin} not found (cargo build --release, or give --refit-bin)")
    names = ["torch gather-broadcast", "torch p2p", "refit launch (reshard)", "refit launch --baseline"]
    if args.old_refit_bin:
        if not os.path.exists(args.old_refit_bin):
            sys.exit(f"error: {args.old_refit_bin} not found")
        names.append(OLD_BASELINE)
    if not have_torch:
        print(SKIP + " (torch variants)", file=sys.stderr)
        names = names[2:]
    per = {n: [] for n in names}  # per round: list of per-refit times
    steps = {n: [] for n in names if not n.startswith("torch")}
    gathers = []  # torch gather-broadcast: training rank 0's gathering, median per round
    for rnd in range(1, args.rounds + 1):
        load = os.getloadavg()
        for n in names:
            if n.startswith("torch"):
                ts, g = run_torch(args, n.split()[1])
                if g is not None:
                    gathers.append(g)
            else:
                binary = args.old_refit_bin if n == OLD_BASELINE else None
                ts, st = run_refit_launch(args, baseline="baseline" in n, binary=binary)
                steps[n].append(st)
            per[n].append(ts)
            print(f"round {rnd} {n:<24} " + " ".join(f"{t:.3f}" for t in ts) + " s", file=sys.stderr, flush=True)
        print(f"round {rnd}: load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", file=sys.stderr, flush=True)
    summary = {}
    sys.stderr.flush()
    print(f"\n{args.src} -> {args.dst}: {args.rounds} rounds x {args.refits} refits (seconds per refit)")
    for n in names:
        flat = [t for r in per[n] for t in r]
        meds = [statistics.median(r) for r in per[n]]
        summary[n] = {"times_s": per[n], "round_medians_s": meds, "min_s": min(flat), "max_s": max(flat)}
        extra = ""
        if n in steps:
            sflat = [t for r in steps[n] for t in r]
            summary[n]["with_fill_s"] = steps[n]
            extra = f"   (with filling the sources: {min(sflat):.3f}-{max(sflat):.3f})"
        if n == "torch gather-broadcast" and gathers:
            summary[n]["gather_round_medians_s"] = gathers
            extra = f"   (of which gathering on rank 0: {min(gathers):.3f}-{max(gathers):.3f})"
        print(f"  {n:<24} per refit {min(flat):.3f}-{max(flat):.3f}; round medians {min(meds):.3f}-{max(meds):.3f}{extra}")
    if have_torch:
        gb = summary["torch gather-broadcast"]["round_medians_s"]
        print("  torch gather-broadcast time / X time, per round (medians; > 1: X is faster):")
        for n in [x for x in names if not x.startswith("torch")] + ["torch p2p"]:
            r = [a / b for a, b in zip(gb, summary[n]["round_medians_s"])]
            summary[n]["gather_broadcast_over_this"] = r
            print(f"    X = {n:<24} {min(r):.2f}-{max(r):.2f}")
        r = [a / b for a, b in zip(summary["torch p2p"]["round_medians_s"], summary["refit launch (reshard)"]["round_medians_s"])]
        summary["refit launch (reshard)"]["torch_p2p_over_this"] = r
        print(f"  torch p2p time / refit launch (reshard) time, per round: {min(r):.2f}-{max(r):.2f}")
    if OLD_BASELINE in summary:
        r = [a / b for a, b in zip(summary[OLD_BASELINE]["round_medians_s"], summary["refit launch --baseline"]["round_medians_s"])]
        summary["refit launch --baseline"]["old_baseline_over_this"] = r
        print(f"  old bin baseline time / refit launch --baseline time, per round: {min(r):.2f}-{max(r):.2f}")
    load = os.getloadavg()
    print(f"  load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps({"compare": summary, "src": args.src, "dst": args.dst, "refits": args.refits, "rounds": args.rounds}), flush=True)


# ------------------------------------------------------------------ main ----


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="source (training) layout file")
    ap.add_argument("--dst", required=True, help="destination (inference) layout file")
    ap.add_argument("--refits", type=int, default=5, help="timed refits per variant (after one warm-up)")
    ap.add_argument("--variant", choices=["both", "gather-broadcast", "p2p"], default="both")
    ap.add_argument("--bucket-mib", type=int, default=256, help="gather-broadcast bucket size")
    ap.add_argument("--timeout", type=int, default=600, help="process group timeout, seconds")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA is present")
    ap.add_argument("--plan-only", action="store_true", help="print both plans' figures; needs no torch")
    ap.add_argument("--compare", action="store_true", help="alternate torch and refit launch, R rounds")
    ap.add_argument("--rounds", type=int, default=3, help="--compare: rounds")
    ap.add_argument("--refit-bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "refit"))
    ap.add_argument("--old-refit-bin", help="--compare: also run `launch --baseline` of this binary (another build) in every round")
    args = ap.parse_args()
    try:
        src, dst = Layout(args.src), Layout(args.dst)
        check_pair(src, dst)
        moves = plan_p2p(src, dst)
        buckets = plan_gather_broadcast(src, dst, args.bucket_mib * MIB)
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.plan_only:
        print(json.dumps({
            "p2p": {"messages": len(moves), "bytes_moved": bytes_p2p(src, moves)},
            "gather-broadcast": {"buckets": len(buckets), "gather_messages": sum(1 for b in buckets for p in b["pieces"] if p[2] != 0),
                                 "bytes_moved": bytes_gather_broadcast(src, dst, buckets)},
            "processes": src.ranks + dst.ranks,
        }))
        return
    try:
        import torch  # noqa: F401
        import torch.multiprocessing as mp
        have_torch = True
    except ImportError:
        have_torch = False
    if args.compare:
        compare(args, have_torch)
        return
    if not have_torch:
        print(SKIP)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = src.ranks + dst.ranks
    failed = mp.get_context("spawn").Value("i", 0)
    try:
        mp.spawn(worker, args=(args, free_port(), args.src, args.dst, world, failed), nprocs=world, join=True)
    except Exception as e:  # a rank raised or died: its traceback is above
        print(f"error: a rank failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        sys.exit(1)
    if failed.value:
        sys.exit(1)


if __name__ == "__main__":
    main()
