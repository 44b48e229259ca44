//! A YAML tree that remembers where every node came from.
//!
//! ```ignore
//! // Crate-private, so not a doctest: the unit test `the_module_example_holds` runs it.
//! let src = Source::new("s.yaml", "block_m: [64, 7]\n");
//! let mut diags = Vec::new();
//! let root = parse(&src, "block_m: [64, 7]\n", &mut diags).unwrap();
//! let NodeKind::Map(entries) = &root.kind else { unreachable!() };
//! let (_, value) = &entries[0];
//! let NodeKind::Seq(items) = &value.kind else { unreachable!() };
//! assert_eq!((items[1].line, items[1].col), (1, 15));
//! ```
//!
//! yaml-rust2's own `Yaml` document drops positions, so this builds the tree from the
//! parser's marked events instead. Only the subset of YAML a spec needs is accepted:
//! one document of mappings, sequences and scalars. Anchors, aliases and tags are
//! rejected with a diagnostic, because silently resolving (or ignoring) them would make
//! the positions in later diagnostics point at the wrong text. Duplicate keys are
//! reported here, where both occurrences are known.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use super::diag::{Diagnostic, Source, ROOT};

/// One YAML node and its 1-based position.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub kind: NodeKind,
    pub line: usize,
    pub col: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum NodeKind {
    /// Entries in file order; a later duplicate key is reported and dropped.
    Map(Vec<(Node, Node)>),
    Seq(Vec<Node>),
    Scalar {
        text: String,
        style: Style,
    },
    /// `~`, `null`, or nothing at all (`key:` with no value).
    Null,
}

/// How a scalar was written: a plain scalar may be a number or a boolean, a quoted (or
/// block) scalar is always a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    Plain,
    Quoted,
}

/// Deeper nesting than this is no spec, and a bound keeps a hostile file from building
/// a tree whose recursive drop would overflow the stack.
const MAX_DEPTH: usize = 64;

/// Parse `text` (the content of `src`) into a tree. Problems go to `diags`; `None` means
/// the tree is unusable (not YAML, empty, several documents, unsupported features) and
/// decoding should stop. Duplicate keys leave a usable tree (the first occurrence wins)
/// so the decoder can still report the rest of the file.
pub(crate) fn parse(src: &Source<'_>, text: &str, diags: &mut Vec<Diagnostic>) -> Option<Node> {
    let mut builder = Builder { src, stack: Vec::new(), root: None, diags, fatal: false };
    let mut parser = Parser::new_from_str(text);
    let mut documents = 0;
    loop {
        let (event, mark) = match parser.next_token() {
            Ok(next) => next,
            Err(e) => {
                builder.scan_error(e.marker(), e.info());
                return None;
            }
        };
        match event {
            Event::StreamEnd => break,
            Event::StreamStart | Event::DocumentEnd | Event::Nothing => {}
            Event::DocumentStart => {
                documents += 1;
                if documents > 1 {
                    let (line, col) = position(&mark);
                    let message = "a spec file holds one YAML document, found a second one";
                    let allowed = "one document (remove this `---` and what follows)";
                    let d = src.diag(line, col, ROOT, message).with_allowed(allowed);
                    builder.diags.push(d);
                    return None;
                }
            }
            Event::Scalar(text, style, anchor, tag) => {
                builder.check_extras(&mark, anchor, tag.as_ref());
                let style = match style {
                    TScalarStyle::Plain => Style::Plain,
                    _ => Style::Quoted,
                };
                let (mut line, mut col) = position(&mark);
                if style == Style::Plain && text.is_empty() {
                    // `key:` with nothing after it yields an empty scalar positioned at
                    // the next token, often on a later line: point at the key instead.
                    if let Some(key) = builder.pending_key() {
                        (line, col) = (key.line, key.col);
                    }
                }
                let kind = if style == Style::Plain && matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL") {
                    NodeKind::Null
                } else {
                    NodeKind::Scalar { text, style }
                };
                builder.finish(Node { kind, line, col });
            }
            Event::Alias(_) => {
                let (line, col) = position(&mark);
                let name = builder.token_at(&mark);
                builder.diags.push(
                    src.diag(line, col, builder.path(), format!("YAML aliases (`{name}`) are not supported"))
                        .with_allowed("the value written out in full at each place it is used"),
                );
                builder.fatal = true;
                builder.finish(Node { kind: NodeKind::Null, line, col });
            }
            Event::SequenceStart(anchor, tag) => {
                builder.check_extras(&mark, anchor, tag.as_ref());
                if !builder.open(&mark, false) {
                    return None;
                }
            }
            Event::MappingStart(anchor, tag) => {
                builder.check_extras(&mark, anchor, tag.as_ref());
                if !builder.open(&mark, true) {
                    return None;
                }
            }
            Event::SequenceEnd | Event::MappingEnd => builder.close(),
        }
    }
    if builder.fatal {
        return None;
    }
    // No document at all (an empty file, only comments), or one that is just null.
    let (line, col) = match builder.root.take() {
        Some(root) if root.kind != NodeKind::Null => return Some(root),
        Some(root) => (root.line, root.col),
        None => (1, 1),
    };
    let allowed = "a mapping with `name`, `op`, `dtypes`, `head_dims`, `variants` and `schedule`";
    let d = src.diag(line, col, ROOT, "the spec is empty").with_allowed(allowed);
    builder.diags.push(d);
    None
}

/// yaml-rust2 markers have a 1-based line and a 0-based column (in characters).
fn position(mark: &Marker) -> (usize, usize) {
    (mark.line().max(1), mark.col() + 1)
}

/// A mapping or sequence whose end has not been seen yet.
struct Frame {
    /// The node's path, for diagnostics about it or its children.
    path: String,
    /// The start event's position (a `[`/`{` for flow collections).
    line: usize,
    col: usize,
    /// Whether the collection opened with `[` or `{`, for the "is a bracket missing?"
    /// hint when the scanner fails inside it.
    flow: Option<char>,
    body: Body,
}

enum Body {
    Seq(Vec<Node>),
    Map {
        entries: Vec<(Node, Node)>,
        /// The key whose value is being parsed.
        key: Option<Node>,
        /// Scalar key text -> position of its first occurrence.
        seen: HashMap<String, (usize, usize)>,
    },
}

struct Builder<'s, 'd> {
    src: &'s Source<'s>,
    stack: Vec<Frame>,
    root: Option<Node>,
    diags: &'d mut Vec<Diagnostic>,
    /// Something the decoder cannot work with was found (an alias, an anchor, a tag).
    fatal: bool,
}

impl Builder<'_, '_> {
    /// The path of the node about to be parsed.
    fn path(&self) -> String {
        let Some(frame) = self.stack.last() else {
            return ROOT.to_string();
        };
        match &frame.body {
            Body::Seq(items) => format!("{}[{}]", frame.path, items.len()),
            Body::Map { key: Some(key), .. } => join(&frame.path, key),
            // A key's own problems are reported against the mapping holding it.
            Body::Map { key: None, .. } => frame.path.clone(),
        }
    }

    /// The key whose value comes next, if a mapping is waiting for one.
    fn pending_key(&self) -> Option<&Node> {
        match &self.stack.last()?.body {
            Body::Map { key, .. } => key.as_ref(),
            Body::Seq(_) => None,
        }
    }

    /// Start a collection; `false` (with a diagnostic) when nesting is too deep to go on.
    fn open(&mut self, mark: &Marker, is_map: bool) -> bool {
        let path = self.path();
        let (line, col) = position(mark);
        if self.stack.len() >= MAX_DEPTH {
            let message = format!("the spec nests more than {MAX_DEPTH} levels deep");
            self.diags.push(self.src.diag(line, col, path, message));
            return false;
        }
        let flow = self.char_at(line, col).filter(|c| matches!(c, '[' | '{'));
        let body = if is_map {
            Body::Map { entries: Vec::new(), key: None, seen: HashMap::new() }
        } else {
            Body::Seq(Vec::new())
        };
        self.stack.push(Frame { path, line, col, flow, body });
        true
    }

    fn close(&mut self) {
        let Some(frame) = self.stack.pop() else {
            return;
        };
        let (mut line, mut col) = (frame.line, frame.col);
        let kind = match frame.body {
            Body::Seq(items) => NodeKind::Seq(items),
            Body::Map { entries, .. } => {
                // A block mapping's start event sits on its first key's `:`; the key
                // itself is where a reader looks for the mapping.
                if let Some((key, _)) = entries.first() {
                    if (key.line, key.col) < (line, col) {
                        (line, col) = (key.line, key.col);
                    }
                }
                NodeKind::Map(entries)
            }
        };
        self.finish(Node { kind, line, col });
    }

    /// Attach a complete node to the collection being built (or make it the root).
    fn finish(&mut self, node: Node) {
        let Some(frame) = self.stack.last_mut() else {
            self.root = Some(node);
            return;
        };
        match &mut frame.body {
            Body::Seq(items) => items.push(node),
            Body::Map { key: slot @ None, .. } => *slot = Some(node),
            Body::Map { entries, key: slot @ Some(_), seen } => {
                let Some(key) = slot.take() else { return };
                if let NodeKind::Scalar { text, .. } = &key.kind {
                    if let Some(&(first_line, first_col)) = seen.get(text) {
                        let message = format!(
                            "duplicate key `{text}` (first defined at line {first_line}, \
                             column {first_col})"
                        );
                        let d = self
                            .src
                            .diag(key.line, key.col, join(&frame.path, &key), message)
                            .with_allowed("each key once per mapping");
                        self.diags.push(d);
                        return;
                    }
                    seen.insert(text.clone(), (key.line, key.col));
                }
                entries.push((key, node));
            }
        }
    }

    fn scan_error(&mut self, mark: &Marker, info: &str) {
        let (line, mut col) = position(mark);
        let mut message = format!("not valid YAML: {info}");
        // The scanner's own words say what broke, not why; the two usual whys are an
        // unclosed flow collection (it fails at some later token) and tabs.
        if let Some(frame) = self.stack.iter().rev().find(|f| f.flow.is_some()) {
            let open = frame.flow.unwrap_or('[');
            let close = if open == '[' { ']' } else { '}' };
            message.push_str(&format!(
                "; the `{open}` at line {}, column {} is still open here: is a `{close}` missing?",
                frame.line, frame.col
            ));
        } else if info.contains("tab") {
            // The scanner stops just after the tab; point at the tab itself.
            if col > 1 && self.char_at(line, col - 1) == Some('\t') {
                col -= 1;
            }
            message.push_str("; YAML indents with spaces, not tabs");
        }
        let path = self.stack.last().map_or_else(|| ROOT.to_string(), |f| f.path.clone());
        self.diags.push(self.src.diag(line, col, path, message));
    }

    /// Report anchors and tags: the tree has no place for them.
    fn check_extras(&mut self, mark: &Marker, anchor: usize, tag: Option<&Tag>) {
        let (line, col) = position(mark);
        let path = self.path();
        if anchor != 0 {
            // The event is marked at the node, after its `&name`: find the anchor in the
            // text to point at it and name it.
            let (line, col, name) = self.property_before(line, col, '&').unwrap_or((line, col, "&name".to_string()));
            let d = self
                .src
                .diag(line, col, path.clone(), format!("YAML anchors (`{name}`) are not supported"))
                .with_allowed("the value written out in full at each place it is used");
            self.diags.push(d);
            self.fatal = true;
        }
        if let Some(tag) = tag {
            // `!!str` arrives expanded to the core schema's URI prefix.
            let shown = match tag.handle.as_str() {
                "tag:yaml.org,2002:" => format!("!!{}", tag.suffix),
                handle => format!("{handle}{}", tag.suffix),
            };
            let (line, col) = self.property_before(line, col, '!').map_or((line, col), |(line, col, _)| (line, col));
            let d = self
                .src
                .diag(line, col, path, format!("YAML tags (`{shown}`) are not supported"))
                .with_allowed("untagged values (quote a value to make it a string)");
            self.diags.push(d);
            self.fatal = true;
        }
    }

    /// The last word starting with `sigil` (an anchor `&a` or a tag `!!str`) before
    /// a node at `line:col`, on the same line or, for a block collection whose first
    /// item starts on the next line, at the end of the line before.
    fn property_before(&self, line: usize, col: usize, sigil: char) -> Option<(usize, usize, String)> {
        let same_line = self.src.line(line).map(|text| {
            let prefix: String = text.chars().take(col.saturating_sub(1)).collect();
            last_word_with(&prefix, sigil)
        });
        if let Some(Some((col, word))) = same_line {
            return Some((line, col, word));
        }
        let previous = self.src.line(line.checked_sub(1)?)?;
        let (col, word) = last_word_with(previous, sigil)?;
        Some((line - 1, col, word))
    }

    /// The character at a 1-based position of the source, if any.
    fn char_at(&self, line: usize, col: usize) -> Option<char> {
        self.src.line(line)?.chars().nth(col.checked_sub(1)?)
    }

    /// The word at a marker (an alias such as `*defaults`), for messages.
    fn token_at(&self, mark: &Marker) -> String {
        let (line, col) = position(mark);
        let word: String = self
            .src
            .line(line)
            .unwrap_or_default()
            .chars()
            .skip(col.saturating_sub(1))
            .take_while(|&c| !is_word_break(c))
            .collect();
        if word.starts_with('*') && word.len() > 1 {
            word
        } else {
            "*name".to_string()
        }
    }
}

/// Whitespace and flow indicators end a word such as `&anchor` or `!!tag`.
fn is_word_break(c: char) -> bool {
    c.is_whitespace() || matches!(c, ',' | '[' | ']' | '{' | '}')
}

/// The last word of `text` that starts with `sigil`, with its 1-based column, if that
/// word is the last one: a property belongs to the node right after it.
fn last_word_with(text: &str, sigil: char) -> Option<(usize, String)> {
    let chars: Vec<char> = text.chars().collect();
    let mut words = Vec::new();
    let mut start = None;
    for (i, &c) in chars.iter().chain(std::iter::once(&' ')).enumerate() {
        match (start, is_word_break(c)) {
            (None, false) => start = Some(i),
            (Some(s), true) => {
                words.push((s, chars[s..i].iter().collect::<String>()));
                start = None;
            }
            _ => {}
        }
    }
    // Properties come in any order (`&a !!str x`), so skip over the other kind.
    words
        .into_iter()
        .rev()
        .take_while(|(_, w)| w.starts_with(['&', '!']))
        .find(|(_, w)| w.starts_with(sigil))
        .map(|(i, w)| (i + 1, w))
}

/// The path of the value under `key` in the mapping at `parent`.
pub fn join(parent: &str, key: &Node) -> String {
    let key = match &key.kind {
        NodeKind::Scalar { text, .. } => text.as_str(),
        _ => "?",
    };
    if parent == ROOT {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(text: &str) -> Node {
        let src = Source::new("t.yaml", text);
        let mut diags = Vec::new();
        let root = parse(&src, text, &mut diags);
        assert!(diags.is_empty(), "{diags:?}");
        root.expect("a tree")
    }

    fn parse_err(text: &str) -> Vec<Diagnostic> {
        let src = Source::new("t.yaml", text);
        let mut diags = Vec::new();
        parse(&src, text, &mut diags);
        assert!(!diags.is_empty());
        diags
    }

    #[test]
    fn the_module_example_holds() {
        let root = parse_ok("block_m: [64, 7]\n");
        let NodeKind::Map(entries) = &root.kind else { panic!("{root:?}") };
        let (_, value) = &entries[0];
        let NodeKind::Seq(items) = &value.kind else { panic!("{value:?}") };
        assert_eq!((items[1].line, items[1].col), (1, 15));
    }

    #[test]
    fn block_mappings_sit_at_their_first_key() {
        let root = parse_ok("# c\n\nname: x\nsub:\n  a: 1\nflow: { b: 2 }\n");
        assert_eq!((root.line, root.col), (3, 1));
        let NodeKind::Map(entries) = &root.kind else { panic!() };
        assert_eq!((entries[1].1.line, entries[1].1.col), (5, 3));
        assert_eq!((entries[2].1.line, entries[2].1.col), (6, 7));
    }

    #[test]
    fn scalar_styles_and_nulls() {
        let root = parse_ok("a: 1\nb: '1'\nc: |\n  x\nd: ~\ne:\nf: null\n");
        let NodeKind::Map(entries) = &root.kind else { panic!() };
        let kinds: Vec<&NodeKind> = entries.iter().map(|(_, v)| &v.kind).collect();
        assert_eq!(kinds[0], &NodeKind::Scalar { text: "1".into(), style: Style::Plain });
        assert_eq!(kinds[1], &NodeKind::Scalar { text: "1".into(), style: Style::Quoted });
        assert_eq!(kinds[2], &NodeKind::Scalar { text: "x\n".into(), style: Style::Quoted });
        assert!(kinds[3..].iter().all(|k| **k == NodeKind::Null));
        // `e:` has no value token: the null is placed at the key.
        assert_eq!((entries[4].1.line, entries[4].1.col), (6, 1));
    }

    #[test]
    fn duplicate_keys_keep_the_first_and_go_on() {
        let text = "a: 1\nb: {x: 1, x: 2}\na: 3\n";
        let src = Source::new("t.yaml", text);
        let mut diags = Vec::new();
        let root = parse(&src, text, &mut diags).expect("still a tree");
        let NodeKind::Map(entries) = &root.kind else { panic!() };
        assert_eq!(entries.len(), 2);
        let found: Vec<(usize, usize, &str)> = diags.iter().map(|d| (d.line, d.column, d.path.as_str())).collect();
        assert_eq!(found, [(2, 11, "b.x"), (3, 1, "a")]);
        assert_eq!(diags[1].message, "duplicate key `a` (first defined at line 1, column 1)");
    }

    #[test]
    fn anchors_aliases_and_tags_are_reported_where_written() {
        let d = parse_err("a: &base 1\nb: *base\nc: !!str 5\nd: &blk\n  - 1\n");
        let found: Vec<(usize, usize, &str)> = d.iter().map(|d| (d.line, d.column, d.message.as_str())).collect();
        assert_eq!(
            found,
            [
                (1, 4, "YAML anchors (`&base`) are not supported"),
                (2, 4, "YAML aliases (`*base`) are not supported"),
                (3, 4, "YAML tags (`!!str`) are not supported"),
                (4, 4, "YAML anchors (`&blk`) are not supported"),
            ]
        );
    }

    #[test]
    fn documents() {
        assert_eq!(parse_err("")[0].message, "the spec is empty");
        assert_eq!(parse_err("# nothing\n")[0].message, "the spec is empty");
        assert_eq!(parse_err("---\n")[0].message, "the spec is empty");
        parse_ok("---\na: 1\n...\n");
        let d = parse_err("a: 1\n---\nb: 2\n");
        assert_eq!((d[0].line, d[0].column), (2, 1));
    }

    #[test]
    fn scan_errors_carry_hints() {
        let d = parse_err("a: {b: 1\nc: 2\n");
        assert!(d[0].message.starts_with("not valid YAML: "), "{}", d[0].message);
        assert!(d[0].message.ends_with("the `{` at line 1, column 4 is still open here: is a `}` missing?"));
        let d = parse_err("a:\n\t- 1\n");
        assert_eq!((d[0].line, d[0].column), (2, 1));
        assert!(d[0].message.ends_with("YAML indents with spaces, not tabs"), "{}", d[0].message);
    }

    #[test]
    fn nesting_is_bounded() {
        // Flow nesting trips the scanner's own limit (255 levels); block nesting has
        // none, and is bounded here.
        let d = parse_err(&"[".repeat(100_000));
        assert!(d[0].message.starts_with("not valid YAML: "), "{}", d[0].message);
        let d = parse_err(&("- ".repeat(10_000) + "1\n"));
        assert_eq!(d[0].message, format!("the spec nests more than {MAX_DEPTH} levels deep"));
        let closed = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        parse_ok(&closed);
    }

    #[test]
    fn property_lookup() {
        assert_eq!(last_word_with("k: &a !!str ", '&'), Some((4, "&a".into())));
        assert_eq!(last_word_with("k: &a !!str ", '!'), Some((7, "!!str".into())));
        assert_eq!(last_word_with("- &a 1", '&'), None);
        assert_eq!(last_word_with("[&a ", '&'), Some((2, "&a".into())));
    }
}
