//! Prometheus text exposition format 0.0.4, by hand: histograms with fixed buckets, families with
//! `# HELP` / `# TYPE` lines, and a parser of one histogram back out of the text (for tests and
//! for readers of `/metrics`).

use std::fmt::Write as _;

/// A histogram with fixed upper bounds (`+Inf` implied).
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; one more than `bounds` (the `+Inf` bucket).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub(crate) fn observe(&mut self, value: f64) {
        let i = self.bounds.iter().position(|b| value <= *b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric family: its name, help, type and the lines of its samples.
pub(crate) struct Family {
    pub(crate) name: &'static str,
    help: &'static str,
    kind: Kind,
    lines: String,
}

impl Family {
    pub(crate) fn new(name: &'static str, help: &'static str, kind: Kind) -> Self {
        Self { name, help, kind, lines: String::new() }
    }

    pub(crate) fn sample(&mut self, labels: Labels, value: f64) {
        line(&mut self.lines, self.name, "", &labels, None, value);
    }

    pub(crate) fn histogram(&mut self, labels: Labels, h: &Histogram) {
        let mut cumulative = 0u64;
        for (i, count) in h.counts.iter().enumerate() {
            cumulative += count;
            let le = h.bounds.get(i).map(|b| number(*b)).unwrap_or_else(|| "+Inf".to_owned());
            line(&mut self.lines, self.name, "_bucket", &labels, Some(&le), cumulative as f64);
        }
        line(&mut self.lines, self.name, "_sum", &labels, None, h.sum);
        line(&mut self.lines, self.name, "_count", &labels, None, h.count as f64);
    }
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        // Rust's shortest round-trip form: integers print without a fraction ("3", "0.0001").
        format!("{v}")
    }
}

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn line(out: &mut String, name: &str, suffix: &str, labels: &Labels, le: Option<&str>, value: f64) {
    out.push_str(name);
    out.push_str(suffix);
    let mut all: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    if let Some(le) = le {
        all.push(format!("le=\"{le}\""));
    }
    if !all.is_empty() {
        let _ = write!(out, "{{{}}}", all.join(","));
    }
    let _ = writeln!(out, " {}", number(value));
}

/// The exposition text of `families` (families with no samples still say HELP and TYPE).
pub(crate) fn render(families: &[Family]) -> String {
    let mut out = String::new();
    for f in families {
        let _ = writeln!(out, "# HELP {} {}", f.name, f.help.replace('\\', "\\\\").replace('\n', "\\n"));
        let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
        out.push_str(&f.lines);
    }
    out
}

/// One histogram series read back from exposition text.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedHistogram {
    /// `(le, cumulative count)`, in the text's order (`+Inf` last, as `f64::INFINITY`).
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
}

/// A sample line's series name, labels and value.
type SampleLine<'a> = (&'a str, Vec<(String, String)>, f64);

/// Splits `name{a="x",b="y"} value` into name, labels and value (no escapes inside values other
/// than `\\`, `\"`, `\n`).
fn parse_line(line: &str) -> Option<SampleLine<'_>> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let Some((name, rest)) = series.split_once('{') else { return Some((series, Vec::new(), value)) };
    let body = rest.strip_suffix('}')?;
    let mut labels = Vec::new();
    let mut chars = body.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('"') {
            return None;
        }
        let mut val = String::new();
        loop {
            match chars.next()? {
                '\\' => match chars.next()? {
                    'n' => val.push('\n'),
                    c => val.push(c),
                },
                '"' => break,
                c => val.push(c),
            }
        }
        labels.push((key.trim_start_matches(',').to_owned(), val));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    Some((name, labels, value))
}

/// The histogram `name` whose labels include all of `want`, if the text has it.
pub fn parse_histogram(text: &str, name: &str, want: &[(&str, &str)]) -> Option<ParsedHistogram> {
    let mut h = ParsedHistogram::default();
    let mut seen = false;
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let Some((series, labels, value)) = parse_line(line) else { continue };
        let Some(suffix) = series.strip_prefix(name) else { continue };
        let matches = want.iter().all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v));
        if !matches {
            continue;
        }
        match suffix {
            "_bucket" => {
                let le = labels.iter().find(|(k, _)| k == "le")?;
                let le = if le.1 == "+Inf" { f64::INFINITY } else { le.1.parse().ok()? };
                h.buckets.push((le, value as u64));
            }
            "_sum" => h.sum = value,
            "_count" => h.count = value as u64,
            _ => continue,
        }
        seen = true;
    }
    seen.then_some(h)
}
