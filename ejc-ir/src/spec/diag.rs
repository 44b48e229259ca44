//! Spec diagnostics: where a problem is, what was found, what is allowed.
//!
//! ```
//! use ejc_ir::spec::load_str;
//! let text = "\
//! name: flash
//! op: ring_attention
//! dtypes: [bf16]
//! head_dims: [64]
//! variants: { full: {} }
//! schedule: { block_m: [64], block_n: [64], num_warps: [4], num_stages: [2] }
//! ";
//! let err = load_str("bad.yaml", text).unwrap_err();
//! let d = &err.diagnostics[0];
//! assert_eq!((d.line, d.column, d.path.as_str()), (2, 5, "op"));
//! assert_eq!(d.short(), "error: bad.yaml:2:5: op: unknown op `ring_attention`");
//! assert_eq!(d.found.as_deref(), Some("a string \"ring_attention\""));
//! eprintln!("{err}"); // every diagnostic, with source lines and carets
//! ```
//!
//! A [`Diagnostic`] renders like a compiler error, with the offending source line and a
//! caret under the column:
//!
//! ```text
//! error: specs/bad.yaml:12:17: schedule.block_m[1]: block size is not a power of two
//!   found: 7
//!   allowed: a power of two from 16 to 256
//!    |
//! 12 |   block_m: [64, 7]
//!    |                 ^
//! ```

use std::fmt;

use crate::limits::{escape_controls, EXCERPT_CHARS, SHOWN_DIAGNOSTICS};

/// One problem in a spec file.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    /// The file as named to the loader.
    pub file: String,
    /// 1-based line; 0 when the problem is about the file as a whole (it could not be read).
    pub line: usize,
    /// 1-based column, counted in characters; 0 together with `line == 0`.
    pub column: usize,
    /// Where in the spec: `schedule.block_m[1]`, `variants.gemma2.sliding_window`,
    /// `<root>` for the top-level mapping, empty when the problem is with the file's bytes
    /// rather than its content (unreadable, not UTF-8).
    pub path: String,
    /// What is wrong, in one line.
    pub message: String,
    /// What the file holds there, in YAML terms (`7`, `a string "abc"`, `a list`).
    pub found: Option<String>,
    /// What would be accepted there.
    pub allowed: Option<String>,
    /// The text of line `line` (at most [`EXCERPT_CHARS`] characters of it, around
    /// the column), shown under the message with a caret.
    pub source_line: Option<String>,
    /// How many characters of the line come before `source_line` (0 unless a long line
    /// was cut to an excerpt).
    pub source_start: usize,
    /// Whether the line goes on after `source_line`.
    pub source_cut: bool,
}

/// Everything wrong with a spec file, in source order (at least one diagnostic).
///
/// At most [`MAX_DIAGNOSTICS`] are kept and [`SHOWN_DIAGNOSTICS`] printed: a spec with
/// thousands of repeated errors prints a screenful and a count, not megabytes.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecError {
    pub diagnostics: Vec<Diagnostic>,
    /// Problems found beyond the ones kept.
    pub omitted: usize,
}

/// The path of the top-level mapping.
pub const ROOT: &str = "<root>";

impl Diagnostic {
    /// A diagnostic with no `found`/`allowed` and no source line.
    pub fn new(
        file: impl Into<String>,
        line: usize,
        column: usize,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Diagnostic {
        Diagnostic {
            file: file.into(),
            line,
            column,
            path: path.into(),
            message: message.into(),
            found: None,
            allowed: None,
            source_line: None,
            source_start: 0,
            source_cut: false,
        }
    }

    /// Attach the text of the diagnostic's line, cut to an excerpt around its column
    /// when it is long.
    pub fn set_source(&mut self, line: &str) {
        let (text, start) = excerpt(line, self.column);
        self.source_cut = start + text.chars().count() < line.chars().count();
        self.source_line = Some(text);
        self.source_start = start;
    }

    #[must_use]
    pub fn with_found(mut self, found: impl Into<String>) -> Diagnostic {
        self.found = Some(found.into());
        self
    }

    #[must_use]
    pub fn with_allowed(mut self, allowed: impl Into<String>) -> Diagnostic {
        self.allowed = Some(allowed.into());
        self
    }

    /// The first line of the rendering: `error: file:line:col: path: message`.
    #[must_use]
    pub fn short(&self) -> String {
        let mut out = format!("error: {}", escape_controls(&self.file));
        if self.line > 0 {
            out.push_str(&format!(":{}:{}", self.line, self.column));
        }
        out.push_str(": ");
        if !self.path.is_empty() {
            out.push_str(&escape_controls(&self.path));
            out.push_str(": ");
        }
        out.push_str(&escape_controls(&self.message));
        out
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short())?;
        if let Some(found) = &self.found {
            write!(f, "\n  found: {}", escape_controls(found))?;
        }
        if let Some(allowed) = &self.allowed {
            write!(f, "\n  allowed: {}", escape_controls(allowed))?;
        }
        if let (Some(source), true) = (&self.source_line, self.line > 0) {
            let number = self.line.to_string();
            let gutter = " ".repeat(number.len());
            // Copy tabs from the source line so the caret lines up however the
            // terminal expands them; an escaped control character is as wide as its
            // escape, every other character one column.
            let mut pad = String::new();
            let mut shown = String::new();
            if self.source_start > 0 {
                shown.push('…');
                pad.push(' ');
            }
            let caret = self.column.saturating_sub(1).saturating_sub(self.source_start);
            for (i, c) in source.chars().enumerate() {
                let text = escape_controls(c.encode_utf8(&mut [0; 4])).into_owned();
                if i < caret {
                    pad.extend(text.chars().map(|t| if t == '\t' { '\t' } else { ' ' }));
                }
                shown.push_str(&text);
            }
            pad.extend(std::iter::repeat_n(' ', caret.saturating_sub(source.chars().count())));
            if self.source_cut {
                shown.push('…');
            }
            write!(f, "\n{gutter} |\n{number} | {shown}\n{gutter} | {pad}^")?;
        }
        Ok(())
    }
}

impl SpecError {
    /// An error with one diagnostic.
    pub fn single(diagnostic: Diagnostic) -> SpecError {
        SpecError { diagnostics: vec![diagnostic], omitted: 0 }
    }

    /// Every problem found, kept or not.
    pub fn count(&self) -> usize {
        self.diagnostics.len() + self.omitted
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.diagnostics.iter().take(SHOWN_DIAGNOSTICS).enumerate() {
            if i > 0 {
                f.write_str("\n\n")?;
            }
            write!(f, "{d}")?;
        }
        let rest = self.count().saturating_sub(SHOWN_DIAGNOSTICS);
        if rest > 0 {
            write!(f, "\n\n... and {rest} more error{} (the first {SHOWN_DIAGNOSTICS} are shown)", plural(rest))?;
        }
        Ok(())
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// At most [`EXCERPT_CHARS`] characters of `line` around the 1-based `column`, and how
/// many characters come before them.
pub fn excerpt(line: &str, column: usize) -> (String, usize) {
    let n = line.chars().count();
    if n <= EXCERPT_CHARS {
        return (line.to_string(), 0);
    }
    let start = column.saturating_sub(1).saturating_sub(EXCERPT_CHARS / 2).min(n - EXCERPT_CHARS);
    (line.chars().skip(start).take(EXCERPT_CHARS).collect(), start)
}

impl std::error::Error for SpecError {}

impl From<Diagnostic> for SpecError {
    fn from(d: Diagnostic) -> SpecError {
        SpecError::single(d)
    }
}

/// The text of a spec split into lines, to attach the offending line to diagnostics.
pub(crate) struct Source<'a> {
    pub file: &'a str,
    lines: Vec<&'a str>,
}

impl<'a> Source<'a> {
    pub fn new(file: &'a str, text: &'a str) -> Source<'a> {
        Source { file, lines: split_lines(text) }
    }

    /// The text of a 1-based line.
    pub fn line(&self, line: usize) -> Option<&'a str> {
        self.lines.get(line.checked_sub(1)?).copied()
    }

    /// A diagnostic at a 1-based `line` and `column`, with that line's text attached.
    pub fn diag(&self, line: usize, column: usize, path: impl Into<String>, message: impl Into<String>) -> Diagnostic {
        let mut d = Diagnostic::new(self.file, line, column, path, message);
        if let Some(text) = self.line(line) {
            d.set_source(text);
        }
        d
    }
}

/// Split on the line breaks YAML knows (`\n`, `\r\n` and a lone `\r`), the ones the
/// scanner counts lines by, so line numbers agree. A trailing break leaves a final empty
/// line: errors "at the end of the file" then still have a line to point at.
fn split_lines(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => {
                lines.push(&text[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&text[start..i]);
                if bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    lines.push(&text[start..]);
    lines
}

/// The candidate closest to `word` (case-insensitive optimal string alignment distance,
/// so a swapped pair of letters counts once), if it is close enough to be a typo:
/// at most one edit per three characters, and at least one.
pub fn suggest<'c>(word: &str, candidates: &[&'c str]) -> Option<&'c str> {
    let word = word.to_lowercase();
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| (edit_distance(&word, &c.to_lowercase()), *c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance: insertions, deletions, substitutions and
/// transpositions of adjacent characters each cost 1.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // Three rolling rows: the transposition step looks two rows back.
    let mut prev2 = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        cur[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(prev2[j - 2] + 1);
            }
        }
        std::mem::swap(&mut prev2, &mut prev);
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_documented_shape() {
        let text = "a: 1\n".repeat(11) + "  block_m: [64, 7]\n";
        let src = Source::new("specs/bad.yaml", &text);
        let d = src
            .diag(12, 17, "schedule.block_m[1]", "block size is not a power of two")
            .with_found("7")
            .with_allowed("a power of two from 16 to 256");
        assert_eq!(
            d.to_string(),
            "error: specs/bad.yaml:12:17: schedule.block_m[1]: block size is not a power of two\n\
             \x20 found: 7\n\
             \x20 allowed: a power of two from 16 to 256\n\
             \x20  |\n\
             12 |   block_m: [64, 7]\n\
             \x20  |                 ^"
        );
        assert_eq!(d.short(), "error: specs/bad.yaml:12:17: schedule.block_m[1]: block size is not a power of two");
    }

    #[test]
    fn file_level_diagnostics_have_no_location_or_snippet() {
        let d = Diagnostic::new("x.yaml", 0, 0, "", "cannot read the spec: gone");
        assert_eq!(d.to_string(), "error: x.yaml: cannot read the spec: gone");
    }

    #[test]
    fn caret_follows_tabs() {
        let src = Source::new("t.yaml", "\tab: x\n");
        let d = src.diag(1, 4, ROOT, "m");
        assert!(d.to_string().ends_with("1 | \tab: x\n  | \t  ^"), "{d}");
    }

    #[test]
    fn several_diagnostics_are_separated_by_a_blank_line() {
        let a = Diagnostic::new("f", 1, 1, "x", "one");
        let b = Diagnostic::new("f", 2, 1, "y", "two");
        let e = SpecError { diagnostics: vec![a, b], omitted: 0 };
        assert_eq!(e.to_string(), "error: f:1:1: x: one\n\nerror: f:2:1: y: two");
    }

    #[test]
    fn lines_split_like_the_yaml_scanner() {
        assert_eq!(split_lines("a\r\nb\rc\nd"), vec!["a", "b", "c", "d"]);
        assert_eq!(split_lines("a\n"), vec!["a", ""]);
        assert_eq!(split_lines(""), vec![""]);
    }

    #[test]
    fn suggestions_catch_typos_only() {
        let keys = ["description", "causal", "sliding_window", "sinks"];
        assert_eq!(suggest("casual", &keys), Some("causal"));
        assert_eq!(suggest("Causal", &keys), Some("causal"));
        assert_eq!(suggest("slidingwindow", &keys), Some("sliding_window"));
        assert_eq!(suggest("sink", &keys), Some("sinks"));
        assert_eq!(suggest("window", &keys), None);
        assert_eq!(suggest("fp8", &["bf16", "f16", "f32"]), None);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("ab", "ba"), 1);
    }
}
