//! The traffic matrix of a plan as an SVG heat map: bytes from every
//! sending rank (rows: source ranks, then destination ranks that relay or
//! fan out) to every destination rank (columns), and the same summed by
//! node. Darker is more; a legend gives the scale.

use crate::units::human;
use reshard::{Group, Plan};
use std::fmt::Write as _;

/// Bytes per (sender, receiver) pair; senders are source ranks then
/// destination ranks, receivers destination ranks (source-to-source gather
/// traffic of the baseline is counted as its own row block too).
fn matrix(plan: &Plan) -> (Vec<Vec<u64>>, usize, usize) {
    let (ns, nd) = (plan.src_ranks() as usize, plan.dst_ranks() as usize);
    let rows = ns + nd;
    let cols = ns + nd;
    let mut m = vec![vec![0u64; cols]; rows];
    let idx = |g: Group, r: u32| match g {
        Group::Src => r as usize,
        Group::Dst => ns + r as usize,
    };
    for t in plan.transfers() {
        if t.from == t.to {
            continue;
        }
        m[idx(t.from.group, t.from.rank)][idx(t.to.group, t.to.rank)] += plan.wire_bytes(t);
    }
    (m, rows, cols)
}

fn shade(bytes: u64, max: u64) -> String {
    if bytes == 0 || max == 0 {
        return "#f4f4f4".into();
    }
    // Log scale over six decades below the maximum.
    let x = ((bytes as f64).log10() - (max as f64).log10() + 6.0).clamp(0.0, 6.0) / 6.0;
    let light = (235.0 - 200.0 * x) as u8;
    format!("rgb({light},{},{})", (light as f64 * 0.9) as u8, 255u8.saturating_sub((40.0 * x) as u8))
}

/// Draws one heat map with its top-left corner at `origin`.
fn panel(out: &mut String, title: &str, m: &[Vec<u64>], labels: (&[String], &[String]), origin: (f64, f64), cell: f64) {
    let (labels_r, labels_c) = labels;
    let (x0, y0) = origin;
    let max = m.iter().flatten().copied().max().unwrap_or(0);
    let _ = writeln!(out, r#"<text x="{x0}" y="{}" font-size="14" font-weight="bold">{title}</text>"#, y0 - 28.0);
    for (j, l) in labels_c.iter().enumerate() {
        let x = x0 + 60.0 + j as f64 * cell + cell / 2.0;
        let _ = writeln!(out, r#"<text x="{x}" y="{}" font-size="9" text-anchor="middle">{l}</text>"#, y0 - 6.0);
    }
    for (i, row) in m.iter().enumerate() {
        let y = y0 + i as f64 * cell;
        let _ = writeln!(out, r#"<text x="{}" y="{}" font-size="9" text-anchor="end">{}</text>"#, x0 + 56.0, y + cell * 0.7, labels_r[i]);
        for (j, &b) in row.iter().enumerate() {
            let x = x0 + 60.0 + j as f64 * cell;
            let _ = writeln!(
                out,
                r#"<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="{}" stroke="white" stroke-width="0.5"><title>{} -> {}: {}</title></rect>"#,
                shade(b, max),
                labels_r[i],
                labels_c[j],
                human(b)
            );
        }
    }
    let _ = writeln!(
        out,
        r#"<text x="{x0}" y="{}" font-size="10">max cell {} (log scale, 6 decades)</text>"#,
        y0 + m.len() as f64 * cell + 14.0,
        human(max)
    );
}

/// Renders both heat maps (ranks and nodes) of `plan` as one SVG document.
pub fn traffic_svg(plan: &Plan, title: &str) -> String {
    let (m, rows, cols) = matrix(plan);
    let ns = plan.src_ranks() as usize;
    let label = |i: usize| if i < ns { format!("s{i}") } else { format!("d{}", i - ns) };
    let labels: Vec<String> = (0..rows.max(cols)).map(label).collect();
    // Keep only rows that send and columns that receive.
    let live_r: Vec<usize> = (0..rows).filter(|&i| m[i].iter().any(|&b| b > 0)).collect();
    let live_c: Vec<usize> = (0..cols).filter(|&j| m.iter().any(|r| r[j] > 0)).collect();
    let rm: Vec<Vec<u64>> = live_r.iter().map(|&i| live_c.iter().map(|&j| m[i][j]).collect()).collect();
    let lr: Vec<String> = live_r.iter().map(|&i| labels[i].clone()).collect();
    let lc: Vec<String> = live_c.iter().map(|&j| labels[j].clone()).collect();
    // Node level: (group, node) per endpoint.
    let node = |i: usize| {
        let (g, n) =
            if i < ns { plan.node_of(reshard::Endpoint::src(i as u32)) } else { plan.node_of(reshard::Endpoint::dst((i - ns) as u32)) };
        (g == Group::Dst, n)
    };
    let mut nodes: Vec<(bool, u32)> = (0..rows.max(cols)).map(node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let ni = |k: (bool, u32)| nodes.iter().position(|&x| x == k).unwrap_or(0);
    let mut nm = vec![vec![0u64; nodes.len()]; nodes.len()];
    for (i, row) in m.iter().enumerate() {
        for (j, &b) in row.iter().enumerate() {
            nm[ni(node(i))][ni(node(j))] += b;
        }
    }
    let nl: Vec<String> = nodes.iter().map(|&(d, n)| format!("{}N{n}", if d { "d" } else { "s" })).collect();
    let live_nr: Vec<usize> = (0..nodes.len()).filter(|&i| nm[i].iter().any(|&b| b > 0)).collect();
    let live_nc: Vec<usize> = (0..nodes.len()).filter(|&j| nm.iter().any(|r| r[j] > 0)).collect();
    let nmm: Vec<Vec<u64>> = live_nr.iter().map(|&i| live_nc.iter().map(|&j| nm[i][j]).collect()).collect();
    let nlr: Vec<String> = live_nr.iter().map(|&i| nl[i].clone()).collect();
    let nlc: Vec<String> = live_nc.iter().map(|&j| nl[j].clone()).collect();

    let cell = (600.0 / (lc.len().max(lr.len()).max(1) as f64)).clamp(4.0, 24.0);
    let ncell = (300.0 / (nlc.len().max(nlr.len()).max(1) as f64)).clamp(8.0, 32.0);
    // Room for each panel's title as well as its cells.
    let w1 = (60.0 + lc.len() as f64 * cell).max(330.0);
    let x2 = 20.0 + w1 + 40.0;
    let width = (x2 + (60.0 + nlc.len() as f64 * ncell).max(200.0) + 20.0).max(20.0 + 9.0 * (title.len() as f64 + 40.0));
    let height = 120.0 + (lr.len() as f64 * cell).max(nlr.len() as f64 * ncell) + 40.0;
    let mut out = String::new();
    let _ = writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif">"#);
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let f = plan.figures();
    let _ = writeln!(
        out,
        r#"<text x="20" y="24" font-size="16" font-weight="bold">{title}: {} plan, bytes moved {} in {} messages</text>"#,
        plan.strategy(),
        human(f.total_bytes),
        f.messages
    );
    panel(&mut out, "ranks: sender (row) to receiver", &rm, (&lr, &lc), (20.0, 90.0), cell);
    panel(&mut out, "nodes: sender to receiver", &nmm, (&nlr, &nlc), (x2, 90.0), ncell);
    out.push_str("</svg>\n");
    out
}
