//! Reading helpers every section shares: located problems (`Problems`, `ConfigError`), a
//! table's keys (`Table`), durations, sizes, addresses, names, header names, and the one
//! globber for the files a config names (`consumer_files`, `[rls] config`).

use std::cell::RefCell;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use super::tree::{Node, Spanned};

pub(super) type Entries = [(Spanned<String>, Spanned<Node>)];

/// Problems found so far, as (byte offset, message); warnings apart; and problems of other
/// files the config names (`consumer_files`), already located.
#[derive(Default)]
pub(super) struct Problems(
    pub(super) RefCell<Vec<(usize, String)>>,
    pub(super) RefCell<Vec<(usize, String)>>,
    pub(super) RefCell<Vec<ConfigError>>,
);

impl Problems {
    pub(super) fn at(&self, span: &Range<usize>, message: impl Into<String>) {
        self.0.borrow_mut().push((span.start, message.into()));
    }

    pub(super) fn warn(&self, span: &Range<usize>, message: impl Into<String>) {
        self.1
            .borrow_mut()
            .push((span.start, format!("warning: {}", message.into())));
    }
}

/// Reads the keys of one table, remembering which were used so the rest can be reported.
pub(super) struct Table<'a> {
    p: &'a Problems,
    name: String,
    pub(super) span: Range<usize>,
    pub(super) entries: &'a Entries,
    used: RefCell<Vec<bool>>,
}

impl<'a> Table<'a> {
    pub(super) fn new(p: &'a Problems, name: &str, node: &'a Spanned<Node>) -> Option<Table<'a>> {
        match &node.value {
            Node::Table(entries) => Some(Table {
                p,
                name: name.to_owned(),
                span: node.span.clone(),
                entries,
                used: RefCell::new(vec![false; entries.len()]),
            }),
            other => {
                p.at(
                    &node.span,
                    format!("`{name}` must be a table, found {}", other.kind()),
                );
                None
            }
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Spanned<Node>> {
        let i = self.entries.iter().position(|(k, _)| k.value == key)?;
        self.used.borrow_mut()[i] = true;
        Some(&self.entries[i].1)
    }

    pub(super) fn key_span(&self, key: &str) -> Range<usize> {
        self.entries
            .iter()
            .find(|(k, _)| k.value == key)
            .map_or(self.span.clone(), |(k, _)| k.span.clone())
    }

    pub(super) fn required(&self, key: &str) -> Option<&'a Spanned<Node>> {
        let found = self.get(key);
        if found.is_none() {
            self.p.at(
                &self.span,
                format!("missing required key `{key}` in {}", self.name),
            );
        }
        found
    }

    /// Reports keys nobody asked for.
    pub(super) fn finish(self) {
        let used = self.used.borrow();
        for ((key, _), used) in self.entries.iter().zip(used.iter()) {
            if !used {
                self.p.at(
                    &key.span,
                    format!("unknown key `{}` in {}", key.value, self.name),
                );
            }
        }
    }

    pub(super) fn wrong_type(&self, key: &str, node: &Spanned<Node>, expected: &str) {
        self.p.at(
            &node.span,
            format!("`{key}` must be {expected}, found {}", node.value.kind()),
        );
    }

    pub(super) fn string(&self, key: &str) -> Option<Spanned<String>> {
        let node = self.get(key)?;
        match &node.value {
            Node::Str(s) => Some(Spanned {
                value: s.clone(),
                span: node.span.clone(),
            }),
            _ => {
                self.wrong_type(key, node, "a string");
                None
            }
        }
    }

    pub(super) fn bool(&self, key: &str) -> Option<bool> {
        let node = self.get(key)?;
        match node.value {
            Node::Bool(b) => Some(b),
            _ => {
                self.wrong_type(key, node, "a boolean");
                None
            }
        }
    }

    /// An integer within `range`.
    pub(super) fn int(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<i64>,
    ) -> Option<Spanned<i64>> {
        let node = self.get(key)?;
        match node.value {
            Node::Int(i) if range.contains(&i) => Some(Spanned {
                value: i,
                span: node.span.clone(),
            }),
            Node::Int(i) => {
                let expected = if *range.end() == i64::MAX {
                    format!("at least {}", range.start())
                } else {
                    format!("between {} and {}", range.start(), range.end())
                };
                self.p
                    .at(&node.span, format!("`{key}` must be {expected}, found {i}"));
                None
            }
            _ => {
                self.wrong_type(key, node, "an integer");
                None
            }
        }
    }

    /// A number, written as a float or an integer.
    pub(super) fn number(&self, key: &str) -> Option<Spanned<f64>> {
        let node = self.get(key)?;
        let value = match node.value {
            Node::Float(f) => f,
            Node::Int(i) => i as f64,
            _ => {
                self.wrong_type(key, node, "a number");
                return None;
            }
        };
        Some(Spanned {
            value,
            span: node.span.clone(),
        })
    }

    pub(super) fn strings(&self, key: &str) -> Option<Vec<Spanned<String>>> {
        let node = self.get(key)?;
        let Node::Array(items) = &node.value else {
            self.wrong_type(key, node, "an array of strings");
            return None;
        };
        let mut out = Vec::new();
        for item in items {
            match &item.value {
                Node::Str(s) => out.push(Spanned {
                    value: s.clone(),
                    span: item.span.clone(),
                }),
                other => self.p.at(
                    &item.span,
                    format!("`{key}` must hold strings, found {}", other.kind()),
                ),
            }
        }
        Some(out)
    }

    pub(super) fn duration(&self, key: &str) -> Option<Spanned<Duration>> {
        let s = self.string(key)?;
        match parse_duration(&s.value) {
            Some(d) => Some(Spanned {
                value: d,
                span: s.span,
            }),
            None => {
                self.p.at(
                    &s.span,
                    format!(
                        "`{key}`: bad duration \"{}\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
                        s.value
                    ),
                );
                None
            }
        }
    }

    /// A string that must be one of `choices`.
    pub(super) fn choice<T: Copy>(&self, key: &str, choices: &[(&str, T)]) -> Option<T> {
        let s = self.string(key)?;
        let found = choices.iter().find(|(name, _)| *name == s.value);
        if found.is_none() {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            self.p.at(
                &s.span,
                format!(
                    "`{key}`: unknown value \"{}\" (expected one of: {})",
                    s.value,
                    names.join(", ")
                ),
            );
        }
        found.map(|(_, v)| *v)
    }

    /// A duration that must be at least 1ms.
    pub(super) fn positive_duration(&self, key: &str, default: Duration) -> Duration {
        match self.duration(key) {
            Some(d) if d.value.is_zero() => {
                self.p.at(&d.span, format!("`{key}` must be at least 1ms"));
                default
            }
            Some(d) => d.value,
            None => default,
        }
    }

    /// A size in bytes: "512KB", "10MB", "1GB", "100B" or a bare number of bytes.
    pub(super) fn size(&self, key: &str) -> Option<u64> {
        let s = self.string(key)?;
        let parsed = parse_size(&s.value);
        if parsed.is_none() {
            self.p.at(
                &s.span,
                format!(
                    "`{key}`: bad size \"{}\" (expected a whole number of bytes with an optional unit: B, KB, MB or GB, e.g. \"512KB\", \"10MB\")",
                    s.value
                ),
            );
        }
        parsed
    }

    pub(super) fn cidrs(&self, key: &str) -> Vec<IpNet> {
        let mut out = Vec::new();
        for s in self.strings(key).unwrap_or_default() {
            match parse_cidr(&s.value) {
                Some(net) => out.push(net),
                None => self.p.at(
                    &s.span,
                    format!("`{key}`: bad CIDR \"{}\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")", s.value),
                ),
            }
        }
        out
    }
}

/// "250ms", "1s", "1m", "1h", "1d".
pub fn parse_duration(s: &str) -> Option<Duration> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let ms_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(n.checked_mul(ms_per_unit)?))
}

/// "512KB", "10MB", "1GB", "100B", "0" (KB = 1024 bytes, as nginx's `k`).
pub fn parse_size(s: &str) -> Option<u64> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let bytes_per_unit: u64 = match unit {
        "" | "B" => 1,
        "KB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(bytes_per_unit)
}

/// A CIDR, or a bare address meaning a single host.
pub(super) fn parse_cidr(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))
}

pub(super) fn socket_addr(p: &Problems, s: &Spanned<String>, key: &str) -> Option<SocketAddr> {
    let parsed = s.value.parse::<SocketAddr>().ok();
    if parsed.is_none() {
        p.at(
            &s.span,
            format!(
                "`{key}`: bad address \"{}\" (expected IP:PORT, e.g. \"127.0.0.1:8080\")",
                s.value
            ),
        );
    }
    parsed
}

/// `[upstreams.NAME]` / `[policies.NAME]`: each child table built by `one`.
pub(super) fn named_tables<T>(
    p: &Problems,
    top: &Table,
    key: &str,
    one: impl Fn(&Problems, &Spanned<String>, &Spanned<Node>) -> Option<T>,
) -> Vec<T> {
    let Some(node) = top.get(key) else {
        return Vec::new();
    };
    let Node::Table(entries) = &node.value else {
        top.wrong_type(key, node, "a table");
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|(name, child)| one(p, name, child))
        .collect()
}

/// Names appear in metric labels and Redis keys: keep them plain.
pub(super) fn check_name(p: &Problems, name: &Spanned<String>, what: &str) {
    let ok = !name.value.is_empty()
        && name
            .value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !ok {
        p.at(
            &name.span,
            format!(
                "bad {what} name \"{}\" (use letters, digits, '_', '-', '.')",
                name.value
            ),
        );
    }
}

/// A header name as written for `key`, or the problem with it.
pub(super) fn header_name(
    p: &Problems,
    s: &Spanned<String>,
    key: &str,
) -> Option<http::HeaderName> {
    match http::HeaderName::from_bytes(s.value.as_bytes()) {
        Ok(name) => Some(name),
        Err(_) => {
            p.at(
                &s.span,
                format!("`{key}`: \"{}\" is not a valid header name", s.value),
            );
            None
        }
    }
}

/// One problem in a config file, already located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

/// Every problem found in a config file, in file order.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("\n"))
    }
}

/// Locates byte-offset problems of `file` (the config, or a file it names), in file order.
pub(super) fn located_in(
    file: &str,
    text: &str,
    problems: Vec<(usize, String)>,
) -> Vec<ConfigError> {
    let mut errors: Vec<ConfigError> = problems
        .into_iter()
        .map(|(at, message)| {
            let (line, col) = line_col(text, at);
            ConfigError {
                file: file.to_owned(),
                line,
                col,
                message,
            }
        })
        .collect();
    errors.sort_by_key(|e| (e.line, e.col));
    errors.dedup();
    errors
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let at = at.min(text.len());
    let before = text.get(..at).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

/// The files `pattern` names, sorted: `*` and `?` in its last component match within one
/// directory, as the shell's globs do (hidden files only when the pattern starts with `.`);
/// a pattern without them names one file, returned whether or not it exists.
pub(super) fn glob(pattern: &Path) -> Result<Vec<PathBuf>, String> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !name.contains(['*', '?']) {
        return Ok(vec![pattern.to_path_buf()]);
    }
    let dir = match pattern.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let listing = |e: std::io::Error| format!("cannot list {}: {e}", dir.display());
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(listing)? {
        let entry = entry.map_err(listing)?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if file.starts_with('.') && !name.starts_with('.') {
            continue;
        }
        if wildcard(name.as_bytes(), file.as_bytes()) && entry.path().is_file() {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

fn wildcard(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.first(), text.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            wildcard(&pattern[1..], text) || (!text.is_empty() && wildcard(pattern, &text[1..]))
        }
        (Some(b'?'), Some(_)) => wildcard(&pattern[1..], &text[1..]),
        (Some(a), Some(b)) if a == b => wildcard(&pattern[1..], &text[1..]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Some(Duration::from_secs(86400)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        for bad in [
            "",
            "1",
            "s",
            "1.5s",
            "-1s",
            "1 s",
            "1sec",
            "99999999999999999999d",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("100"), Some(100));
        assert_eq!(parse_size("100B"), Some(100));
        assert_eq!(parse_size("512KB"), Some(512 * 1024));
        assert_eq!(parse_size("10MB"), Some(10 * 1024 * 1024));
        assert_eq!(parse_size("1GB"), Some(1 << 30));
        for bad in [
            "",
            "KB",
            "1.5MB",
            "-1",
            "1 MB",
            "1mb",
            "1TB",
            "99999999999999999999GB",
        ] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn line_col_counts_from_one() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(line_col(text, 0), (1, 1));
        assert_eq!(line_col(text, 6), (2, 1));
        assert_eq!(line_col(text, text.find('=').unwrap_or(0)), (1, 3));
        assert_eq!(line_col(text, 10), (2, 4));
    }

    #[test]
    fn globs_match_like_the_shell() {
        assert!(wildcard(b"*.yaml", b"a.yaml"));
        assert!(wildcard(b"rl-?.yaml", b"rl-1.yaml"));
        assert!(!wildcard(b"*.yaml", b"a.yml"));
        assert!(wildcard(b"*", b""));
        assert!(!wildcard(b"a*b", b"ac"));
        // What consumer files were matched with before the two globbers became one.
        assert!(wildcard(b"*.toml", b"acme.toml"));
        assert!(!wildcard(b"*.toml", b"acme.toml.bak"));
        assert!(wildcard(b"team-*-prod.toml", b"team-a-prod.toml"));
        assert!(!wildcard(b"team-*-prod.toml", b"team-a-dev.toml"));
        assert!(wildcard(b"*", b"x"));
    }
}
