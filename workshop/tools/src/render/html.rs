//! Draws a [`Timeline`] as one self-contained HTML page (inline SVG and CSS, no script, no
//! network): a lane per participant, a numbered bar per step span with its figures in an SVG
//! `<title>` (shown on hover), a time axis per panel, and the TTFT decomposition below.
//!
//! Stable hooks for tests and tools: each lane is `<g class="lane" data-lane="…">`, each bar
//! `<g class="bar" data-step="NN">`, each TTFT part `<g class="ttft-part" data-part="…">`.

use std::fmt::Write as _;

use super::{Bar, Timeline, LANES};

const WIDTH: f64 = 1500.0;
const LABEL_W: f64 = 120.0;
const GAP_W: f64 = 46.0;
const LANE_H: f64 = 44.0;
const TOP: f64 = 40.0;
const TTFT_H: f64 = 34.0;

/// Colours per lane (participants of the same node share a hue).
const COLOURS: [&str; 9] =
    ["#6b7280", "#7c3aed", "#2563eb", "#1d4ed8", "#3b82f6", "#d97706", "#059669", "#047857", "#10b981"];
const PART_COLOURS: [&str; 7] = ["#7c3aed", "#2563eb", "#1d4ed8", "#dc2626", "#059669", "#10b981", "#d1d5db"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn ms(us: u64) -> String {
    format!("{:.3} ms", us as f64 / 1e3)
}

/// A horizontal panel: pixels `[x0, x0 + w)` for microseconds `[0, span_us]`.
struct Panel {
    x0: f64,
    w: f64,
    span_us: u64,
}

impl Panel {
    fn x(&self, us: u64) -> f64 {
        self.x0 + self.w * (us as f64 / self.span_us.max(1) as f64)
    }
}

fn panel_span(bars: &[Bar]) -> u64 {
    bars.iter().map(|b| b.start_us + b.duration_us).max().unwrap_or(1).max(1)
}

fn axis(svg: &mut String, p: &Panel, y: f64, title: &str) {
    let _ = write!(svg, r##"<text class="panel-title" x="{:.1}" y="{:.1}">{}</text>"##, p.x0, TOP - 24.0, esc(title));
    let ticks: u64 = if p.w < 400.0 { 2 } else { 4 };
    for i in 0..=ticks {
        let us = p.span_us * i / ticks;
        let x = p.x(us);
        let _ = write!(svg, r##"<line class="tick" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{y:.1}"/>"##, TOP - 6.0);
        let anchor = if i == ticks { "end" } else { "start" };
        let _ = write!(
            svg,
            r##"<text class="tick-label" x="{x:.1}" y="{:.1}" text-anchor="{anchor}">{}</text>"##,
            TOP - 9.0,
            ms(us)
        );
    }
}

fn bars(svg: &mut String, p: &Panel, bars: &[Bar]) {
    // Labels in a lane go on one of two rows so that neighbours do not overprint.
    let mut last_label_end = [[f64::MIN; 2]; 9];
    for b in bars {
        let lane = b.lane.min(LANES.len() - 1);
        let y = TOP + lane as f64 * LANE_H;
        let x = p.x(b.start_us);
        let w = (p.x(b.start_us + b.duration_us) - x).max(2.0);
        let mut tip =
            format!("step {} · {} · {}\nstart +{} · {}", b.step, b.name, b.service, ms(b.start_us), ms(b.duration_us));
        for (k, v) in &b.figures {
            let _ = write!(tip, "\n{k} = {v}");
        }
        let label = b.step.to_string();
        let label_w = 7.0 * label.len() as f64 + 4.0;
        // The row whose last label ends first; the label moves right rather than overprint.
        let row = usize::from(last_label_end[lane][1] < last_label_end[lane][0]);
        let lx = x.max(last_label_end[lane][row]);
        last_label_end[lane][row] = lx + label_w;
        let ly = y + 14.0 + row as f64 * 20.0;
        let _ = write!(
            svg,
            r##"<g class="bar" data-step="{step:02}"><title>{tip}</title><rect x="{x:.2}" y="{ry:.1}" width="{w:.2}" height="{h:.1}" rx="2" fill="{fill}"/><text class="num" x="{lx:.2}" y="{ly:.1}">{label}</text></g>"##,
            step = b.step,
            tip = esc(&tip),
            ry = y + 16.0 + row as f64 * 4.0,
            h = LANE_H - 26.0,
            fill = COLOURS[lane],
        );
    }
}

/// The page.
pub fn page(t: &Timeline) -> String {
    let rows = ttft_rows(t);
    let missing = if t.missing.is_empty() {
        String::new()
    } else {
        format!("<p class=\"missing\">steps not in the trace: {:?}</p>", t.missing)
    };
    document(&esc(&t.trace_id), &timeline_svg(t), &rows, &missing)
}

/// The start-up panel (no width when the trace has no start-up spans) and the request panel.
fn panels(t: &Timeline) -> (Panel, Panel) {
    let body_w = WIDTH - LABEL_W - 20.0;
    let has_startup = !t.startup.is_empty();
    let startup_w = if has_startup { (body_w - GAP_W) * 0.22 } else { 0.0 };
    let sp = Panel { x0: LABEL_W, w: startup_w, span_us: panel_span(&t.startup) };
    let rp = Panel {
        x0: LABEL_W + if has_startup { startup_w + GAP_W } else { 0.0 },
        w: body_w - if has_startup { startup_w + GAP_W } else { 0.0 },
        span_us: panel_span(&t.request),
    };
    (sp, rp)
}

/// The timeline: lanes, both panels' axes and bars, the gap between them, the TTFT bar.
fn timeline_svg(t: &Timeline) -> String {
    let (sp, rp) = panels(t);
    let lanes_bottom = TOP + LANES.len() as f64 * LANE_H;
    let ttft_y = lanes_bottom + 30.0;
    let height = ttft_y + TTFT_H + 40.0;

    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" id="timeline" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="12">"##
    );
    lanes(&mut svg);
    if !t.startup.is_empty() {
        axis(&mut svg, &sp, lanes_bottom, "start-up (steps 1–7)");
        gap(&mut svg, &sp, lanes_bottom, t.gap_us);
    }
    axis(&mut svg, &rp, lanes_bottom, &format!("request (steps 8–43) · trace {}", t.trace_id));
    bars(&mut svg, &sp, &t.startup);
    bars(&mut svg, &rp, &t.request);
    ttft_parts(&mut svg, t, &rp, ttft_y);
    svg.push_str("</svg>");
    svg
}

/// A lane per participant, its name on the left.
fn lanes(svg: &mut String) {
    for (i, name) in LANES.iter().enumerate() {
        let y = TOP + i as f64 * LANE_H;
        let _ = write!(
            svg,
            r##"<g class="lane" data-lane="{n}"><rect class="lane-bg" x="0" y="{y:.1}" width="{WIDTH}" height="{LANE_H}" fill="{bg}"/><text class="lane-label" x="8" y="{ty:.1}">{n}</text></g>"##,
            n = esc(name),
            bg = if i % 2 == 0 { "#f9fafb" } else { "#ffffff" },
            ty = y + LANE_H / 2.0 + 4.0,
        );
    }
}

/// The dashed line after the start-up panel, labelled with the time until the request's first span.
fn gap(svg: &mut String, sp: &Panel, lanes_bottom: f64, gap_us: u64) {
    let gx = sp.x0 + sp.w + GAP_W / 2.0;
    let _ = write!(
        svg,
        r##"<line class="gap" x1="{gx:.1}" y1="{TOP}" x2="{gx:.1}" y2="{lanes_bottom:.1}"/><text class="gap-label" x="{gx:.1}" y="{:.1}" text-anchor="middle">+{}</text>"##,
        lanes_bottom + 14.0,
        ms(gap_us)
    );
}

/// The TTFT decomposition, on the request panel's scale.
fn ttft_parts(svg: &mut String, t: &Timeline, rp: &Panel, ttft_y: f64) {
    let Some(ttft) = t.ttft_us else { return };
    let _ = write!(
        svg,
        r##"<text class="ttft-title" x="8" y="{:.1}">TTFT {}</text>"##,
        ttft_y + TTFT_H / 2.0 + 4.0,
        ms(ttft)
    );
    let named: Vec<&str> = super::TTFT_SEGMENTS.iter().map(|s| s.0).collect();
    for seg in &t.ttft {
        let colour = named.iter().position(|n| *n == seg.label).map(|i| PART_COLOURS[i]).unwrap_or(PART_COLOURS[6]);
        let x = rp.x(seg.start_us);
        let w = (rp.x(seg.end_us) - x).max(1.0);
        let _ = write!(
            svg,
            r##"<g class="ttft-part" data-part="{label}"><title>{label} {steps} · {d}</title><rect x="{x:.2}" y="{ttft_y:.1}" width="{w:.2}" height="{TTFT_H}" fill="{colour}"/>{text}</g>"##,
            label = esc(&seg.label),
            steps = esc(&seg.steps),
            d = ms(seg.end_us - seg.start_us),
            text = if w > 7.0 * (seg.label.len() as f64 + 1.0) {
                format!(
                    r##"<text class="part-label" x="{:.2}" y="{:.1}">{}</text>"##,
                    x + 4.0,
                    ttft_y + TTFT_H / 2.0 + 4.0,
                    esc(&seg.label)
                )
            } else {
                String::new()
            },
        );
    }
}

/// The TTFT table's rows: part, steps, time, share of TTFT.
fn ttft_rows(t: &Timeline) -> String {
    let mut rows = String::new();
    let Some(ttft) = t.ttft_us else { return rows };
    for seg in &t.ttft {
        let d = seg.end_us - seg.start_us;
        let _ = write!(
            rows,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td></tr>",
            esc(&seg.label),
            esc(&seg.steps),
            ms(d),
            100.0 * d as f64 / ttft.max(1) as f64
        );
    }
    rows
}

/// The HTML document around the timeline, the TTFT table and the missing steps; `trace` is
/// escaped already.
fn document(trace: &str, svg: &str, rows: &str, missing: &str) -> String {
    format!(
        r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdflow timeline · trace {trace}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #111827; }}
.num {{ font-size: 11px; fill: #111827; }}
.lane-label {{ font-weight: 600; fill: #374151; }}
.tick {{ stroke: #e5e7eb; }} .tick-label, .gap-label {{ font-size: 10px; fill: #6b7280; }}
.gap {{ stroke: #9ca3af; stroke-dasharray: 4 3; }} .panel-title, .ttft-title {{ font-weight: 600; fill: #374151; }}
.part-label {{ font-size: 11px; fill: #ffffff; }}
.bar:hover rect {{ stroke: #111827; stroke-width: 1.5; }}
table {{ border-collapse: collapse; margin-top: 12px; }} td, th {{ border: 1px solid #e5e7eb; padding: 3px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
</style></head>
<body>
<h1>pdflow · one request, step by step</h1>
<p>Each bar is one step span (<code>step.NN.short_name</code>) at its real time; hover for its figures. The start-up panel and the request panel have their own scales.</p>
{svg}
<h2>TTFT decomposition</h2>
<table id="ttft"><tr><th>part</th><th>steps</th><th>time</th><th>share</th></tr>{rows}</table>
{missing}
</body></html>
"##,
    )
}
