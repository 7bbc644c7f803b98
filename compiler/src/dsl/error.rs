//! Diagnostics of the DSL: [`DslError`] (a `miette::Diagnostic` carrying its source)
//! and its plain rustc-style rendering, plus the "did you mean" helper.

use super::ast::Span;
use miette::{
    Diagnostic, LabeledSpan, MietteError, MietteSpanContents, NamedSource, SourceCode, SourceSpan,
    SpanContents,
};
use std::fmt;

/// A diagnostic without its source: what the parser and the lowering produce.
/// [`super::compile_source`] attaches the file to make a [`DslError`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Diag {
    pub message: String,
    pub span: Span,
    pub label: String,
    pub help: Option<String>,
}

impl Diag {
    /// An error at `span` with `message`, underlined with `label`.
    pub fn new(span: Span, message: impl Into<String>, label: impl Into<String>) -> Diag {
        Diag {
            message: message.into(),
            span,
            label: label.into(),
            help: None,
        }
    }

    /// Adds a help line.
    pub fn help(mut self, help: impl Into<String>) -> Diag {
        self.help = Some(help.into());
        self
    }

    /// Adds a help line if there is one.
    pub fn maybe_help(mut self, help: Option<String>) -> Diag {
        self.help = help;
        self
    }
}

/// A mistake in a DSL file, located in its source.
///
/// It is a [`miette::Diagnostic`] (with the source as a `NamedSource`, one labelled
/// span and, where useful, a help line) for fancy terminal output, and renders
/// without colour through [`DslError::render_plain`] for snapshots, logs and
/// non-terminals.
pub struct DslError(Box<Inner>);

struct Inner {
    diag: Diag,
    source: NamedSource<String>,
    /// The error's line cut to a readable width, when it is longer than that.
    window: Option<LineWindow>,
}

/// Lines longer than this (in characters) are shown as a window around the error:
/// nobody reads a 60,000-column line, and miette's renderer cannot pad a caret past
/// column 65,535 (it panics).
const MAX_SHOWN_CHARS: usize = 160;
/// How many characters of the line a window shows before the error's start.
const SHOWN_BEFORE: usize = 60;

/// A window of one long source line: `…` where it was cut, the error's span inside it.
struct LineWindow {
    name: String,
    text: String,
    /// Byte range of the (clipped) span in `text`.
    span: std::ops::Range<usize>,
    /// 0-based line and column (chars) of the span's start in the file.
    line: usize,
    col: usize,
}

impl LineWindow {
    /// The window of `span`'s line, if that line is too long to show whole.
    fn of(name: &str, src: &str, span: Span) -> Option<LineWindow> {
        let loc = locate(src, span.start);
        let chars: Vec<char> = src[loc.line_start..loc.line_end].chars().collect();
        if chars.len() <= MAX_SHOWN_CHARS {
            return None;
        }
        let at = loc.col - 1;
        let end_col = at
            + src[span.start..span.end.clamp(span.start, loc.line_end)]
                .chars()
                .count();
        let first = at.saturating_sub(SHOWN_BEFORE);
        let last = (first + MAX_SHOWN_CHARS).min(chars.len());
        let piece = |a: usize, b: usize| display(&chars[a..b].iter().collect::<String>());
        let mut text = String::new();
        if first > 0 {
            text.push('…');
        }
        text.push_str(&piece(first, at.min(last)));
        let start = text.len();
        text.push_str(&piece(at.min(last), end_col.clamp(at, last)));
        let end = text.len();
        text.push_str(&piece(end_col.clamp(at, last), last));
        if last < chars.len() {
            text.push('…');
        }
        Some(LineWindow {
            name: name.to_string(),
            text,
            span: start..end,
            line: loc.line - 1,
            col: at,
        })
    }
}

impl SourceCode for LineWindow {
    fn read_span<'a>(
        &'a self,
        span: &SourceSpan,
        before: usize,
        after: usize,
    ) -> Result<Box<dyn SpanContents<'a> + 'a>, MietteError> {
        let inner = self.text.read_span(span, before, after)?;
        // The window is one line: the file's line, and the column of the error's
        // start in the file when the span read is the error's own.
        let column = if span.offset() == self.span.start {
            self.col
        } else {
            inner.column()
        };
        Ok(Box::new(MietteSpanContents::new_named(
            self.name.clone(),
            inner.data(),
            *inner.span(),
            self.line + inner.line(),
            column,
            inner.line_count(),
        )))
    }
}

impl DslError {
    pub(crate) fn new(file_name: &str, src: &str, mut diag: Diag) -> DslError {
        // Spans come from the parser or from other spans, so they lie on char
        // boundaries; clamp anyway so that no rendering can slice a char in two.
        diag.span.start = floor_boundary(src, diag.span.start);
        diag.span.end = floor_boundary(src, diag.span.end.max(diag.span.start));
        let window = LineWindow::of(file_name, src, diag.span);
        DslError(Box::new(Inner {
            diag,
            source: NamedSource::new(file_name, src.to_string()),
            window,
        }))
    }

    /// The message, without location (the first line of [`Self::render_plain`]).
    pub fn message(&self) -> &str {
        &self.0.diag.message
    }

    /// The label under the span.
    pub fn label(&self) -> &str {
        &self.0.diag.label
    }

    /// The help line, if any.
    pub fn help_text(&self) -> Option<&str> {
        self.0.diag.help.as_deref()
    }

    /// The byte range in the source the error points at.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.0.diag.span.range()
    }

    /// The name of the file, as given to `compile_source`.
    pub fn file_name(&self) -> &str {
        self.0.source.name()
    }

    /// 1-based line and column (in characters) of the start of the span.
    pub fn line_col(&self) -> (usize, usize) {
        let loc = locate(self.0.source.inner(), self.0.diag.span.start);
        (loc.line, loc.col)
    }

    /// The plain-text rendering, rustc style, no colour:
    ///
    /// ```text
    /// error: shape mismatch in matmul: inner dimensions differ: f32[64,784] @ f32[128,10] (784 vs 128)
    ///  --> model.dsl:9:12
    ///   |
    /// 9 |   logits = h @ w2
    ///   |            ^^^^^^ f32[64,784] @ f32[128,10]
    ///   |
    ///   = help: ...
    /// ```
    pub fn render_plain(&self) -> String {
        let src = self.0.source.inner();
        let d = &self.0.diag;
        let loc = locate(src, d.span.start);
        let (line, pad, width) = match &self.0.window {
            Some(w) => (
                w.text.clone(),
                w.text[..w.span.start].chars().count(),
                w.text[w.span.clone()].chars().count(),
            ),
            None => {
                let end = d.span.end.clamp(d.span.start, loc.line_end);
                (
                    display(&src[loc.line_start..loc.line_end]),
                    display(&src[loc.line_start..d.span.start]).chars().count(),
                    display(&src[d.span.start..end]).chars().count(),
                )
            }
        };
        let width = width.max(1);
        let num = loc.line.to_string();
        let gutter = " ".repeat(num.len());
        let mut out = String::new();
        out.push_str(&format!("error: {}\n", d.message));
        out.push_str(&format!(
            "{gutter}--> {}:{}:{}\n",
            self.file_name(),
            loc.line,
            loc.col
        ));
        out.push_str(&format!("{gutter} |\n"));
        out.push_str(&format!("{num} | {line}\n"));
        let carets = format!("{}{}", " ".repeat(pad), "^".repeat(width));
        if d.label.is_empty() {
            out.push_str(&format!("{gutter} | {carets}\n"));
        } else {
            out.push_str(&format!("{gutter} | {carets} {}\n", d.label));
        }
        if let Some(help) = &d.help {
            out.push_str(&format!("{gutter} |\n"));
            out.push_str(&format!("{gutter} = help: {help}\n"));
        }
        out
    }
}

impl fmt::Debug for DslError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DslError")
            .field("file", &self.file_name())
            .field("message", &self.0.diag.message)
            .field("span", &self.0.diag.span)
            .field("label", &self.0.diag.label)
            .field("help", &self.0.diag.help)
            .finish()
    }
}

impl fmt::Display for DslError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.diag.message)
    }
}

impl std::error::Error for DslError {}

impl Diagnostic for DslError {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        None
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.0
            .diag
            .help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display + 'a>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        match &self.0.window {
            Some(w) => Some(w),
            None => Some(&self.0.source),
        }
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let d = &self.0.diag;
        let label = (!d.label.is_empty()).then(|| d.label.clone());
        let span = match &self.0.window {
            Some(w) => (w.span.start, w.span.len()),
            None => (d.span.start, d.span.end - d.span.start),
        };
        Some(Box::new(std::iter::once(
            LabeledSpan::new_primary_with_span(label, span),
        )))
    }
}

/// Where a byte offset lies: its line (1-based), column in chars (1-based), and the
/// byte range of its line without the line break.
struct Location {
    line: usize,
    col: usize,
    line_start: usize,
    line_end: usize,
}

fn locate(src: &str, pos: usize) -> Location {
    let pos = floor_boundary(src, pos);
    let line_start = src[..pos].rfind('\n').map_or(0, |i| i + 1);
    let mut line_end = src[pos..].find('\n').map_or(src.len(), |i| pos + i);
    if line_end > pos && src[..line_end].ends_with('\r') {
        line_end -= 1;
    }
    Location {
        line: src[..pos].matches('\n').count() + 1,
        col: src[line_start..pos].chars().count() + 1,
        line_start,
        line_end,
    }
}

/// The 1-based line of byte offset `pos`.
pub(crate) fn line_of(src: &str, pos: usize) -> usize {
    locate(src, pos).line
}

/// The largest char boundary at or below `pos` (and at most `src.len()`).
pub(crate) fn floor_boundary(src: &str, pos: usize) -> usize {
    let mut p = pos.min(src.len());
    while !src.is_char_boundary(p) {
        p -= 1;
    }
    p
}

/// A source line as shown: tabs as four spaces, control characters as `�`, so the
/// caret line stays aligned and the output stays printable.
fn display(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\t' => out.push_str("    "),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// Edit distance between two names: insertions, deletions, substitutions and swaps of
/// adjacent characters (`rleu` is one edit from `relu`).
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// The candidates close to `name`, closest first (at most `max`).
pub(crate) fn close_names<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    max: usize,
) -> Vec<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    let lower = name.to_lowercase();
    let mut scored: Vec<(usize, &str)> = candidates
        .into_iter()
        .filter(|c| *c != name)
        .filter_map(|c| {
            let d = distance(&lower, &c.to_lowercase());
            let prefix =
                c.len() >= 3 && lower.len() >= 3 && (c.starts_with(&lower) || lower.starts_with(c));
            (d <= limit || prefix).then_some((d, c))
        })
        .collect();
    scored.sort();
    scored.dedup();
    scored.into_iter().take(max).map(|(_, c)| c).collect()
}

/// `did you mean `x`?` when a candidate is close to `name`.
pub(crate) fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let close = close_names(name, candidates, 3);
    match close.as_slice() {
        [] => None,
        [one] => Some(format!("did you mean `{one}`?")),
        many => Some(format!("did you mean one of {}?", backticked(many, "or"))),
    }
}

/// "`a`, `b` or `c`".
pub(crate) fn backticked(names: &[&str], last: &str) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.len() {
        0 => String::new(),
        1 => quoted[0].clone(),
        n => format!("{} {last} {}", quoted[..n - 1].join(", "), quoted[n - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(
            close_names("rleu", ["relu", "tanh", "exp"], 3),
            vec!["relu"]
        );
        assert_eq!(
            did_you_mean("glorit", ["glorot", "he"]).as_deref(),
            Some("did you mean `glorot`?")
        );
        assert_eq!(did_you_mean("zzz", ["glorot", "he"]), None);
    }

    /// Found by the DSL fuzzer: an error past column 65,535 made miette panic.
    #[test]
    fn long_line_shows_a_window() {
        let at = 70_000;
        let src = format!("{}bad rest{}\nnext\n", "x".repeat(at), "y".repeat(at));
        let diag = Diag::new(
            Span {
                start: at,
                end: at + 3,
            },
            "no such thing",
            "here",
        );
        let e = DslError::new("m.dsl", &src, diag);
        let plain = e.render_plain();
        assert!(
            plain.contains(&format!("--> m.dsl:1:{}", at + 1)),
            "{plain}"
        );
        let shown = plain.lines().nth(3).expect("a source line");
        assert!(
            shown.starts_with("1 | …x") && shown.ends_with('…'),
            "{shown}"
        );
        assert!(shown.chars().count() < MAX_SHOWN_CHARS + 10, "{shown}");
        let caret = plain.lines().nth(4).expect("a caret line");
        let col = caret.chars().position(|c| c == '^').expect("a caret");
        let under: String = shown.chars().skip(col).take(3).collect();
        assert_eq!(under, "bad", "{plain}");
        let fancy = format!("{:?}", miette::Report::new(e));
        assert!(fancy.contains(&format!("m.dsl:1:{}", at + 1)), "{fancy}");
        assert!(
            fancy.contains("bad rest") && fancy.contains("here"),
            "{fancy}"
        );
    }

    #[test]
    fn locate_lines() {
        let src = "ab\ncd\r\nef";
        let l = locate(src, 4);
        assert_eq!(
            (l.line, l.col, &src[l.line_start..l.line_end]),
            (2, 2, "cd")
        );
        let l = locate(src, src.len());
        assert_eq!((l.line, l.col), (3, 3));
    }
}
