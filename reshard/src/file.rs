//! The layout file format (JSON): the edge type that converts into the IR.
//!
//! Parsing has two paths. The fast one (`typed`) deserializes the text
//! straight into the IR's tensors with serde visitors; when it accepts a
//! file, [`Layout::new`] validates the result. When it does not, the
//! reference walker (`walk`) parses the text into a `serde_json::Value`
//! tree and walks it by hand so that the error names the field path
//! (`tensors[3].shards[0].extent[1]`) and the tensor. Both accept exactly the
//! same files and build the same tensors (`cross_check` tests this). See
//! `docs/layout-format.md` for the format itself.

/// A serde visitor that is its own
/// [`DeserializeSeed`](serde::de::DeserializeSeed): `$visitor` asks the
/// deserializer for what `$kind` names (`deserialize_seq`,
/// `deserialize_map`, ...), expects `$expecting`, and builds a `$value`
/// with the `visit_*` methods given.
/// The caller has `DeserializeSeed`, `Deserializer` and `Visitor` in scope.
macro_rules! visitor_seed {
    ($visitor:ty => $value:ty, $kind:ident, $expecting:literal, { $($visit:item)* }) => {
        impl<'de> DeserializeSeed<'de> for $visitor {
            type Value = $value;
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<$value, D::Error> {
                d.$kind(self)
            }
        }

        impl<'de> Visitor<'de> for $visitor {
            type Value = $value;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($expecting)
            }
            $($visit)*
        }
    };
}

mod typed;

use crate::dtype::DType;
pub(crate) use crate::layout::validate::escape;
use crate::layout::{
    BlockScale, Layout, LayoutError, MeshDim, MeshPlacement, Placement, Region, ShardSpec, Storage, TensorLayout, MAX_RANKS,
};
use serde_json::{Map, Value};

/// Parses a layout file's text into a validated [`Layout`].
pub fn parse_layout(text: &str) -> Result<Layout, LayoutError> {
    check_bom(text)?;
    match typed::parse(text) {
        // The walker would build the same tensors, so `Layout::new` would
        // give the same answer: no need to walk.
        Ok(p) => Layout::new(p.ranks, p.ranks_per_node, p.tensors),
        // Rare (a bad file): walk it again to name the field at fault.
        Err(_) => walk(text),
    }
}

/// Rejects a UTF-8 byte-order mark with a message that says so (JSON has
/// none, and serde_json would only say "expected value").
fn check_bom(text: &str) -> Result<(), LayoutError> {
    if text.starts_with('\u{feff}') {
        return Err(err("(file)", "invalid JSON: the file starts with a byte-order mark (U+FEFF); save it as UTF-8 without one"));
    }
    Ok(())
}

/// Runs both parsing paths on `text` and says how they disagree, if they
/// do: the fast path must accept exactly what the walker accepts and build
/// the same layout (or fail `Layout::new` with the same error). For tests.
#[cfg(any(test, feature = "testkit"))]
pub fn cross_check(text: &str) -> Result<(), String> {
    let slow = check_bom(text).and_then(|()| walk(text));
    let fast = match check_bom(text).ok().map(|()| typed::parse(text)) {
        Some(Ok(p)) => Some(Layout::new(p.ranks, p.ranks_per_node, p.tensors)),
        _ => None,
    };
    match (fast, slow) {
        (Some(f), s) if f != s => Err(format!("fast path gave {f:?}, the walker {s:?}")),
        (None, Ok(_)) => Err("the fast path rejects a file the walker accepts".to_string()),
        _ => Ok(()),
    }
}

/// The reference parser: parses `text` into a `serde_json::Value` tree and
/// walks it, naming the field path in every error, then builds the layout.
fn walk(text: &str) -> Result<Layout, LayoutError> {
    let v: Value = strict_json(text).map_err(|e| err("(file)", format!("invalid JSON: {}", escape(&e.to_string()))))?;
    let obj = as_object(&v, "(top level)")?;
    known_fields(obj, "(top level)", &["ranks", "ranks_per_node", "tensors"])?;
    let ranks = get_u32(obj, "ranks", "")?;
    if ranks > MAX_RANKS {
        return Err(err("ranks", format!("{ranks} ranks; at most {MAX_RANKS} are supported")));
    }
    let ranks_per_node = match obj.get("ranks_per_node") {
        None | Some(Value::Null) => None,
        Some(v) => Some(to_u32(v, "ranks_per_node")?),
    };
    let tensors_v = obj.get("tensors").ok_or_else(|| err("tensors", "missing field"))?;
    let arr = tensors_v.as_array().ok_or_else(|| err("tensors", format!("expected an array, got {}", kind(tensors_v))))?;
    let mut tensors = Vec::with_capacity(arr.len());
    let mut budget = MAX_IMPLIED_POSITIONS;
    for (i, t) in arr.iter().enumerate() {
        tensors.push(parse_tensor(t, &format!("tensors[{i}]"), ranks, &mut budget)?);
    }
    Layout::new(ranks, ranks_per_node, tensors)
}

/// Most mesh positions a file may leave implied (meshes without
/// `mesh.ranks`, whose rank lists the parser writes out): 2^26 in all, so
/// that a small file cannot make the parser allocate gigabytes.
pub(crate) const MAX_IMPLIED_POSITIONS: u64 = 1 << 26;

fn parse_tensor(v: &Value, path: &str, layout_ranks: u32, budget: &mut u64) -> Result<TensorLayout, LayoutError> {
    let obj = as_object(v, path)?;
    let name = match obj.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(err(format!("{path}.name"), format!("expected a string, got {}", kind(other)))),
        None => return Err(err(format!("{path}.name"), "missing field")),
    };
    let path = format!("{path} ('{}')", escape(&name));
    known_fields(obj, &path, &["name", "dtype", "shape", "mesh", "placements", "shards", "buffer", "at", "scale"])?;
    let dtype = match obj.get("dtype") {
        Some(Value::String(s)) => DType::from_name(s).ok_or_else(|| {
            err(
                format!("{path}.dtype"),
                format!("unknown dtype '{}' (expected one of f64 f32 bf16 f16 f8e4m3 f8e5m2 i64 i32 i8 u8)", escape(s)),
            )
        })?,
        Some(other) => return Err(err(format!("{path}.dtype"), format!("expected a string, got {}", kind(other)))),
        None => return Err(err(format!("{path}.dtype"), "missing field")),
    };
    let shape = get_u64_list(obj, "shape", &path)?;
    let has_mesh = obj.contains_key("mesh") || obj.contains_key("placements");
    let has_shards = obj.contains_key("shards");
    let placement = match (has_mesh, has_shards) {
        (true, true) => return Err(err(&path, "has both 'shards' and 'mesh'/'placements'; give exactly one form")),
        (false, false) => return Err(err(&path, "has neither 'shards' nor 'mesh'+'placements'; give exactly one form")),
        (true, false) => Placement::Mesh(parse_mesh(obj, &path, layout_ranks, budget)?),
        (false, true) => {
            if let Some(k) = ["buffer", "at"].into_iter().find(|k| obj.contains_key(*k)) {
                return Err(err(
                    format!("{path}.{k}"),
                    "a tensor-level 'buffer'/'at' belongs to the mesh form; with 'shards', give them per shard",
                ));
            }
            let sv = &obj["shards"];
            let arr = sv.as_array().ok_or_else(|| err(format!("{path}.shards"), format!("expected an array, got {}", kind(sv))))?;
            let mut shards = Vec::with_capacity(arr.len());
            for (i, s) in arr.iter().enumerate() {
                shards.push(parse_shard(s, &format!("{path}.shards[{i}]"))?);
            }
            Placement::Shards(shards)
        }
    };
    let scale = match obj.get("scale") {
        None => None,
        Some(v) => Some(parse_scale(v, &format!("{path}.scale"))?),
    };
    Ok(TensorLayout { name, dtype, shape, placement, scale })
}

/// A tensor's `scale`: `{"tensor": "<name>", "block": [b0, b1, ...]}`.
fn parse_scale(v: &Value, path: &str) -> Result<BlockScale, LayoutError> {
    let obj = as_object(v, path)?;
    known_fields(obj, path, &["tensor", "block"])?;
    let tensor = match obj.get("tensor") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(err(format!("{path}.tensor"), format!("expected a string, got {}", kind(other)))),
        None => return Err(err(format!("{path}.tensor"), "missing field")),
    };
    let block = get_u64_list(obj, "block", path)?;
    Ok(BlockScale { tensor, block })
}

fn parse_mesh(obj: &Map<String, Value>, path: &str, layout_ranks: u32, budget: &mut u64) -> Result<MeshPlacement, LayoutError> {
    let mv = obj.get("mesh").ok_or_else(|| err(format!("{path}.mesh"), "missing field (required with 'placements')"))?;
    let mesh = as_object(mv, &format!("{path}.mesh"))?;
    known_fields(mesh, &format!("{path}.mesh"), &["shape", "ranks"])?;
    let mpath = format!("{path}.mesh");
    let shape: Vec<u32> = get_u64_list(mesh, "shape", &mpath)?
        .into_iter()
        .enumerate()
        .map(|(i, s)| u32::try_from(s).map_err(|_| err(format!("{mpath}.shape[{i}]"), format!("{s} is too large"))))
        .collect::<Result<_, _>>()?;
    let size = shape.iter().try_fold(1u64, |a, &b| a.checked_mul(b as u64));
    let size_text = size.map_or_else(|| format!("more than {}", u64::MAX), |s| s.to_string());
    let size = size.unwrap_or(u64::MAX);
    let ranks = match mesh.get("ranks") {
        None | Some(Value::Null) => {
            if size > layout_ranks as u64 {
                return Err(err(
                    format!("{mpath}.shape"),
                    format!(
                        "mesh {shape:?} has {size_text} positions but the layout has {layout_ranks} ranks (and no mesh.ranks is given)"
                    ),
                ));
            }
            *budget = budget.checked_sub(size).ok_or_else(|| {
                err(
                    format!("{mpath}.shape"),
                    format!(
                        "meshes without mesh.ranks imply more than {MAX_IMPLIED_POSITIONS} positions in all; \
                         give mesh.ranks explicitly (or fewer, smaller meshes)"
                    ),
                )
            })?;
            (0..size as u32).collect()
        }
        Some(_) => get_u64_list(mesh, "ranks", &mpath)?
            .into_iter()
            .enumerate()
            .map(|(i, r)| u32::try_from(r).map_err(|_| err(format!("{mpath}.ranks[{i}]"), format!("rank {r} is too large"))))
            .collect::<Result<_, _>>()?,
    };
    let pv = obj.get("placements").ok_or_else(|| err(format!("{path}.placements"), "missing field (required with 'mesh')"))?;
    let parr = pv.as_array().ok_or_else(|| err(format!("{path}.placements"), format!("expected an array, got {}", kind(pv))))?;
    let mut dims = Vec::with_capacity(parr.len());
    for (i, p) in parr.iter().enumerate() {
        let ppath = format!("{path}.placements[{i}]");
        let s = p.as_str().ok_or_else(|| err(&ppath, format!("expected a string, got {}", kind(p))))?;
        dims.push(
            parse_mesh_dim(s)
                .ok_or_else(|| err(&ppath, format!("unknown placement '{}' (expected \"replicate\" or \"shard(D)\")", escape(s))))?,
        );
    }
    let storage = parse_storage(obj, path)?;
    Ok(MeshPlacement { shape, ranks, dims, storage })
}

/// The optional `buffer` (a string) and `at` (default 0) of a mesh-form
/// tensor or of a shard.
fn parse_storage(obj: &Map<String, Value>, path: &str) -> Result<Storage, LayoutError> {
    match (obj.get("buffer"), obj.get("at")) {
        (None, None) => Ok(Storage::Own),
        (Some(Value::String(b)), at) => {
            let at = match at {
                None => 0,
                Some(v) => to_u64(v, &format!("{path}.at"))?,
            };
            Ok(Storage::InBuffer { buffer: b.clone(), at })
        }
        (Some(other), _) => Err(err(format!("{path}.buffer"), format!("expected a string, got {}", kind(other)))),
        (None, Some(_)) => Err(err(format!("{path}.at"), "given without 'buffer'")),
    }
}

/// Parses `replicate` or `shard(D)`.
pub fn parse_mesh_dim(s: &str) -> Option<MeshDim> {
    let s = s.trim();
    if s == "replicate" {
        return Some(MeshDim::Replicate);
    }
    let inner = s.strip_prefix("shard(")?.strip_suffix(')')?;
    inner.trim().parse::<usize>().ok().map(MeshDim::Shard)
}

fn parse_shard(v: &Value, path: &str) -> Result<ShardSpec, LayoutError> {
    let obj = as_object(v, path)?;
    known_fields(obj, path, &["rank", "offset", "extent", "flat", "buffer", "at"])?;
    let rank = get_u32(obj, "rank", path)?;
    let has_box = obj.contains_key("offset") || obj.contains_key("extent");
    let region = match (has_box, obj.contains_key("flat")) {
        (true, true) => return Err(err(path, "has both 'offset'/'extent' and 'flat'; give one")),
        (false, false) => return Err(err(path, "needs 'offset'+'extent' or 'flat'")),
        (true, false) => Region::Block { offset: get_u64_list(obj, "offset", path)?, extent: get_u64_list(obj, "extent", path)? },
        (false, true) => {
            let f = get_u64_list(obj, "flat", path)?;
            if f.len() != 2 {
                return Err(err(format!("{path}.flat"), format!("expected [start, len], got {} numbers", f.len())));
            }
            Region::Flat { start: f[0], len: f[1] }
        }
    };
    let storage = parse_storage(obj, path)?;
    Ok(ShardSpec { rank, region, storage })
}

fn err(field: impl Into<String>, problem: impl Into<String>) -> LayoutError {
    LayoutError::Field { field: field.into(), problem: problem.into() }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn as_object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, LayoutError> {
    v.as_object().ok_or_else(|| err(path, format!("expected an object, got {}", kind(v))))
}

fn known_fields(obj: &Map<String, Value>, path: &str, known: &[&str]) -> Result<(), LayoutError> {
    for k in obj.keys() {
        if !known.contains(&k.as_str()) {
            return Err(err(path, format!("unknown field '{}' (expected one of: {})", escape(k), known.join(", "))));
        }
    }
    Ok(())
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn to_u64(v: &Value, path: &str) -> Result<u64, LayoutError> {
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(|| err(path, format!("expected a non-negative integer, got {n}"))),
        other => Err(err(path, format!("expected a non-negative integer, got {}", kind(other)))),
    }
}

fn to_u32(v: &Value, path: &str) -> Result<u32, LayoutError> {
    let n = to_u64(v, path)?;
    u32::try_from(n).map_err(|_| err(path, format!("{n} is too large (at most {})", u32::MAX)))
}

fn get_u32(obj: &Map<String, Value>, key: &str, path: &str) -> Result<u32, LayoutError> {
    let p = join(path, key);
    to_u32(obj.get(key).ok_or_else(|| err(&p, "missing field"))?, &p)
}

fn get_u64_list(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Vec<u64>, LayoutError> {
    let p = join(path, key);
    let v = obj.get(key).ok_or_else(|| err(&p, "missing field"))?;
    let arr = v.as_array().ok_or_else(|| err(&p, format!("expected an array of integers, got {}", kind(v))))?;
    arr.iter().enumerate().map(|(i, x)| to_u64(x, &format!("{p}[{i}]"))).collect()
}

/// Writes a layout back in the file format (mesh placements stay compact).
pub fn layout_to_json(layout: &Layout) -> Value {
    let tensors: Vec<Value> = layout
        .tensors()
        .iter()
        .map(|t| {
            let mut o = Map::new();
            o.insert("name".into(), Value::from(t.name.clone()));
            o.insert("dtype".into(), Value::from(t.dtype.name()));
            o.insert("shape".into(), Value::from(t.shape.clone()));
            if let Some(scale) = &t.scale {
                let mut so = Map::new();
                so.insert("tensor".into(), Value::from(scale.tensor.clone()));
                so.insert("block".into(), Value::from(scale.block.clone()));
                o.insert("scale".into(), Value::Object(so));
            }
            match &t.placement {
                Placement::Mesh(m) => {
                    let mut mesh = Map::new();
                    mesh.insert("shape".into(), Value::from(m.shape.clone()));
                    // Ranks 0, 1, 2, ... in mesh order are the default: leave
                    // them out (model layouts shrink several-fold).
                    if !m.ranks.iter().enumerate().all(|(i, &r)| r as usize == i) {
                        mesh.insert("ranks".into(), Value::from(m.ranks.clone()));
                    }
                    o.insert("mesh".into(), Value::Object(mesh));
                    let p: Vec<Value> = m
                        .dims
                        .iter()
                        .map(|d| match d {
                            MeshDim::Replicate => Value::from("replicate"),
                            MeshDim::Shard(d) => Value::from(format!("shard({d})")),
                        })
                        .collect();
                    o.insert("placements".into(), Value::Array(p));
                    if let Storage::InBuffer { buffer, at } = &m.storage {
                        o.insert("buffer".into(), Value::from(buffer.clone()));
                        o.insert("at".into(), Value::from(*at));
                    }
                }
                Placement::Shards(shards) => {
                    let s: Vec<Value> = shards
                        .iter()
                        .map(|s| {
                            let mut so = Map::new();
                            so.insert("rank".into(), Value::from(s.rank));
                            match &s.region {
                                Region::Block { offset, extent } => {
                                    so.insert("offset".into(), Value::from(offset.clone()));
                                    so.insert("extent".into(), Value::from(extent.clone()));
                                }
                                Region::Flat { start, len } => {
                                    so.insert("flat".into(), Value::from(vec![*start, *len]));
                                }
                            }
                            if let Storage::InBuffer { buffer, at } = &s.storage {
                                so.insert("buffer".into(), Value::from(buffer.clone()));
                                so.insert("at".into(), Value::from(*at));
                            }
                            Value::Object(so)
                        })
                        .collect();
                    o.insert("shards".into(), Value::Array(s));
                }
            }
            Value::Object(o)
        })
        .collect();
    let mut top = Map::new();
    top.insert("ranks".into(), Value::from(layout.ranks()));
    top.insert("ranks_per_node".into(), Value::from(layout.ranks_per_node()));
    top.insert("tensors".into(), Value::Array(tensors));
    Value::Object(top)
}

/// Parses JSON like `serde_json::from_str`, but rejects an object that
/// names the same key twice (serde_json would silently keep the last).
fn strict_json(text: &str) -> Result<Value, serde_json::Error> {
    use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
    struct Strict;
    visitor_seed!(Strict => Value, deserialize_any, "a JSON value", {
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = seq.next_element_seed(Strict)? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut out = Map::new();
            while let Some(k) = map.next_key::<String>()? {
                let v = map.next_value_seed(Strict)?;
                if out.insert(k.clone(), v).is_some() {
                    return Err(A::Error::custom(format!("duplicate key '{}'", escape(&k))));
                }
            }
            Ok(Value::Object(out))
        }
    });
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Strict.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-tensor layout on 4 ranks.
    fn one(tensor: &str) -> String {
        format!(r#"{{"ranks": 4, "tensors": [{tensor}]}}"#)
    }

    /// Hand-written edge cases for the two parsing paths: number forms,
    /// nulls, key order, repeated and escaped keys, both forms and neither.
    fn edge_cases() -> Vec<String> {
        let mut cases: Vec<String> = Vec::new();
        top_level_cases(&mut cases);
        tensor_cases(&mut cases);
        mesh_cases(&mut cases);
        shard_cases(&mut cases);
        whole_file_cases(&mut cases);
        cases
    }

    /// The file's own fields: `ranks`, `ranks_per_node`, the top level.
    fn top_level_cases(cases: &mut Vec<String>) {
        for ranks in ["4", "4.0", "1e0", "-1", "-0", "0", "\"4\"", "null", "1048576", "1048577", "4294967296", "18446744073709551616"] {
            cases.push(format!(r#"{{"ranks": {ranks}, "tensors": []}}"#));
        }
        for rpn in ["null", "0", "2", "9", "-1", "1.5", "2.0", "\"2\"", "4294967295", "4294967296", "[]"] {
            cases.push(format!(r#"{{"ranks": 4, "ranks_per_node": {rpn}, "tensors": []}}"#));
        }
        for top in [
            "",
            " ",
            "null",
            "[]",
            "{}",
            r#"{"ranks": 4}"#,
            r#"{"tensors": []}"#,
            r#"{"ranks": 4, "tensors": null}"#,
            r#"{"ranks": 4, "tensors": {}}"#,
            r#"{"ranks": 4, "tensors": [null]}"#,
            r#"{"ranks": 4, "tensors": [], "x": 1}"#,
            r#"{"ranks": 4, "ranks": 4, "tensors": []}"#,
            r#"{"ranks": 4, "tensors": [], "tensors": []}"#,
            r#"{"ranks": 4, "tensors": []} x"#,
            r#"{"ranks": 4, "tensors": []} {}"#,
            "{\"ranks\": 4, \"tensors\": []}\n\t ",
            "\u{feff}{\"ranks\": 4, \"tensors\": []}",
            r#"{"ra\u006eks": 4, "tensors": []}"#,
            r#"{"ranks": 4, "tensors": [], "ranks_per_node": null, "ranks_per_node": null}"#,
        ] {
            cases.push(top.to_string());
        }
    }

    /// A tensor's fields: keys, `name`, `dtype`, `shape`.
    fn tensor_cases(cases: &mut Vec<String>) {
        let mesh = r#""dtype": "f32", "shape": [8], "mesh": {"shape": [4]}, "placements": ["shard(0)"]"#;
        for t in [
            format!(r#"{{"name": "w", {mesh}}}"#),
            format!(r#"{{"name": "w", {mesh}, "name": "v"}}"#),
            format!(r#"{{"na\u006de": "w", {mesh}}}"#),
            format!(r#"{{"name": "w\u0000", {mesh}}}"#),
            format!(r#"{{"name": "", {mesh}}}"#),
            format!(r#"{{"name": null, {mesh}}}"#),
            format!(r#"{{"name": 5, {mesh}}}"#),
            format!(r#"{{{mesh}}}"#),
            format!(r#"{{"name": "w", {mesh}, "x": null}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "b"}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "b", "at": 4}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "b", "at": null}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "b", "at": 4.0}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "b", "at": -1}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": "", "at": 4}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": null}}"#),
            format!(r#"{{"name": "w", {mesh}, "buffer": 5}}"#),
            format!(r#"{{"name": "w", {mesh}, "at": 4}}"#),
            format!(r#"{{"name": "w", {mesh}, "at": null}}"#),
            format!(r#"{{"name": "w", {mesh}, "shards": []}}"#),
            format!(r#"{{"name": "w", {mesh}, "shards": null}}"#),
            r#"{"name": "w", "dtype": "f32", "shape": [8]}"#.to_string(),
            r#"{"name": "w", "dtype": "f32", "shape": [8], "mesh": {"shape": [4]}}"#.to_string(),
            r#"{"name": "w", "dtype": "f32", "shape": [8], "placements": ["shard(0)"]}"#.to_string(),
            r#"{"name": "w", "dtype": "f32", "shape": [8], "mesh": null, "placements": ["shard(0)"]}"#.to_string(),
            r#"{"name": "w", "dtype": "f32", "shape": [8], "mesh": {"shape": [4]}, "placements": null}"#.to_string(),
        ] {
            cases.push(one(&t));
        }
        for dtype in ["\"f32\"", "\"bf\\u00316\"", "\"F32\"", "\"f32 \"", "null", "5", "[\"f32\"]"] {
            cases.push(one(&format!(
                r#"{{"name": "w", "dtype": {dtype}, "shape": [8], "mesh": {{"shape": [4]}}, "placements": ["shard(0)"]}}"#
            )));
        }
        for shape in [
            "[8]",
            "[]",
            "[8, 0]",
            "[8.0]",
            "[-8]",
            "[-0]",
            "[1e1]",
            "null",
            "8",
            "[null]",
            "[18446744073709551615, 2]",
            "[1,1,1,1,1,1,1,1,1]",
        ] {
            cases.push(one(&format!(
                r#"{{"name": "w", "dtype": "u8", "shape": {shape}, "mesh": {{"shape": [4]}}, "placements": ["replicate"]}}"#
            )));
        }
    }

    /// A mesh placement: `mesh` and `placements`.
    fn mesh_cases(cases: &mut Vec<String>) {
        for m in [
            r#"{"shape": [4]}"#,
            r#"{"shape": [2, 2]}"#,
            r#"{"shape": [5]}"#,
            r#"{"shape": [0]}"#,
            r#"{"shape": []}"#,
            r#"{"shape": null}"#,
            r#"{"shape": [4.0]}"#,
            r#"{"shape": [4294967296]}"#,
            r#"{"shape": [4294967295, 4294967295, 4294967295]}"#,
            r#"{"shape": [4], "ranks": null}"#,
            r#"{"shape": [4], "ranks": [3, 2, 1, 0]}"#,
            r#"{"shape": [2], "ranks": [3, 1]}"#,
            r#"{"shape": [4], "ranks": [0, 1, 2]}"#,
            r#"{"shape": [4], "ranks": [0, 1, 2, 2]}"#,
            r#"{"shape": [4], "ranks": [0, 1, 2, 4]}"#,
            r#"{"shape": [4], "ranks": [0, 1, 2, 4294967296]}"#,
            r#"{"shape": [4], "ranks": [0, 1, 2, -3]}"#,
            r#"{"shape": [4], "ranks": {}}"#,
            r#"{"shape": [4], "shape": [4]}"#,
            r#"{"shape": [4], "ranks": null, "ranks": [0, 1, 2, 3]}"#,
            r#"{"ranks": [0, 1, 2, 3]}"#,
            r#"{}"#,
            r#"{"shape": [4], "x": 1}"#,
            r#"[]"#,
        ] {
            cases.push(one(&format!(r#"{{"name": "w", "dtype": "u8", "shape": [8], "mesh": {m}, "placements": ["replicate"]}}"#)));
        }
        for p in [
            r#"["shard(0)"]"#,
            r#"[" shard( 0 ) "]"#,
            r#"["shard(1)"]"#,
            r#"["shard(-1)"]"#,
            r#"["shard(+0)"]"#,
            r#"["Replicate"]"#,
            r#"["replicate", "replicate"]"#,
            r#"[]"#,
            r#"[null]"#,
            r#"[0]"#,
            r#""replicate""#,
        ] {
            cases.push(one(&format!(r#"{{"name": "w", "dtype": "u8", "shape": [8], "mesh": {{"shape": [4]}}, "placements": {p}}}"#)));
        }
    }

    /// Explicit shards.
    fn shard_cases(cases: &mut Vec<String>) {
        for s in [
            r#"{"rank": 0, "offset": [0], "extent": [8]}"#,
            r#"{"rank": 0, "flat": [0, 8]}"#,
            r#"{"rank": 0, "flat": [0, 8], "buffer": "b"}"#,
            r#"{"rank": 0, "flat": [0, 8], "buffer": "b", "at": 3}"#,
            r#"{"rank": 0, "flat": [0, 8], "at": 3}"#,
            r#"{"rank": 0, "flat": [0, 8], "buffer": null}"#,
            r#"{"rank": 0, "flat": [0, 8], "buffer": "b", "at": null}"#,
            r#"{"rank": 0, "flat": [0]}"#,
            r#"{"rank": 0, "flat": [0, 8, 1]}"#,
            r#"{"rank": 0, "flat": null}"#,
            r#"{"rank": 0, "offset": [0]}"#,
            r#"{"rank": 0, "extent": [8]}"#,
            r#"{"rank": 0, "offset": [0], "extent": [8], "flat": [0, 8]}"#,
            r#"{"rank": 0}"#,
            r#"{"rank": null, "flat": [0, 8]}"#,
            r#"{"rank": 4, "flat": [0, 8]}"#,
            r#"{"rank": 1.0, "flat": [0, 8]}"#,
            r#"{"rank": -0, "flat": [0, 8]}"#,
            r#"{"flat": [0, 8]}"#,
            r#"{"rank": 0, "rank": 0, "flat": [0, 8]}"#,
            r#"{"rank": 0, "flat": [0, 8], "x": {}}"#,
            r#"{"rank": 0, "offset": [0], "extent": [9]}"#,
            r#"null"#,
        ] {
            cases.push(one(&format!(r#"{{"name": "w", "dtype": "u8", "shape": [8], "shards": [{s}]}}"#)));
        }
        for t in [
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": []}"#,
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": {}}"#,
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": [], "buffer": "b"}"#,
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": [], "at": 0}"#,
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": [], "placements": []}"#,
            r#"{"name": "w", "dtype": "u8", "shape": [8], "shards": [], "shards": []}"#,
        ] {
            cases.push(one(t));
        }
    }

    /// Whole files: `ranks` after the tensors, buffers shared by tensors.
    fn whole_file_cases(cases: &mut Vec<String>) {
        // `ranks` after the tensors: implied meshes are checked against it at the end.
        let implied =
            |n: u32| format!(r#"{{"name": "w", "dtype": "u8", "shape": [8], "mesh": {{"shape": [{n}]}}, "placements": ["replicate"]}}"#);
        cases.push(format!(r#"{{"tensors": [{}], "ranks": 4}}"#, implied(4)));
        cases.push(format!(r#"{{"tensors": [{}], "ranks": 3}}"#, implied(4)));
        cases.push(format!(r#"{{"tensors": [{}], "ranks": 1048577}}"#, implied(1048577)));
        cases.push(format!(r#"{{"tensors": [{}]}}"#, implied(4)));
        // Two tensors sharing a buffer, in order and overlapping.
        let in_buf = |name: &str, at: u64| {
            format!(
                r#"{{"name": "{name}", "dtype": "u8", "shape": [8], "mesh": {{"shape": [4]}}, "placements": ["shard(0)"], "buffer": "b", "at": {at}}}"#
            )
        };
        cases.push(format!(r#"{{"ranks": 4, "tensors": [{}, {}]}}"#, in_buf("a", 0), in_buf("c", 2)));
        cases.push(format!(r#"{{"ranks": 4, "tensors": [{}, {}]}}"#, in_buf("a", 0), in_buf("c", 1)));
        cases.push(format!(r#"{{"ranks": 4, "tensors": [{}, {}]}}"#, in_buf("a", 0), in_buf("a", 2)));
    }

    /// Every edge case: both paths agree.
    #[test]
    fn paths_agree_on_edge_cases() {
        let failures: Vec<String> =
            edge_cases().iter().filter_map(|text| cross_check(text).err().map(|e| format!("{text}\n    {e}"))).collect();
        assert!(failures.is_empty(), "{} cases:\n{}", failures.len(), failures.join("\n"));
    }

    /// Both paths agree on the example layouts and the hostile files.
    #[test]
    fn paths_agree_on_fixture_files() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for dir in ["examples", "tests/hostile/layouts"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir)) else { continue };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    files.extend(std::fs::read_dir(&p).into_iter().flatten().flatten().map(|e| e.path()));
                } else {
                    files.push(p);
                }
            }
        }
        files.retain(|p| p.extension().is_some_and(|e| e == "json"));
        assert!(files.len() >= 40, "found only {} fixture files", files.len());
        for p in &files {
            let bytes = std::fs::read(p).unwrap();
            let text = String::from_utf8_lossy(&bytes);
            cross_check(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }

    /// The examples are accepted by the fast path itself (no fallback).
    #[test]
    fn examples_take_the_fast_path() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        // (Layout pairs are the folders with a src.json; examples/ also
        // holds programs, one of them a folder.)
        for dir in std::fs::read_dir(root).unwrap().flatten().filter(|e| e.path().join("src.json").is_file()) {
            for side in ["src.json", "dst.json"] {
                let text = std::fs::read_to_string(dir.path().join(side)).unwrap();
                assert!(typed::parse(&text).is_ok(), "{}/{side}", dir.path().display());
            }
        }
    }

    /// Past `MAX_IMPLIED_POSITIONS`, both paths reject the file.
    #[test]
    fn paths_agree_on_the_implied_budget() {
        let t = |i: usize| {
            format!(r#"{{"name": "w{i}", "dtype": "u8", "shape": [8], "mesh": {{"shape": [1048576]}}, "placements": ["replicate"]}}"#)
        };
        for n in [64, 65] {
            let text = format!(r#"{{"ranks": 1048576, "tensors": [{}]}}"#, (0..n).map(t).collect::<Vec<_>>().join(","));
            assert_eq!(typed::parse(&text).is_ok(), n == 64);
            if n == 65 {
                cross_check(&text).unwrap();
            }
        }
    }
}
