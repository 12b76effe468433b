//! A policy's `reject = { body_file, content_type }` (DESIGN §20): the body of its 429s,
//! read from a file at load and reload and split once into literal text and placeholders,
//! so a rejection only copies bytes.

use std::ops::Range;
use std::path::Path;

use super::read::{Problems, Table};
use super::tree::{Node, Spanned};

/// The default `content_type` of a `reject` body.
pub const DEFAULT_CONTENT_TYPE: &str = "application/json";

/// What a `reject` body may name; each `{name}` is replaced when a request is rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    /// `{policy}`: the policy's name.
    Policy,
    /// `{limit}`: the limit the request was decided with (an override's, or the policy's).
    Limit,
    /// `{period}`: the period as written in the config, e.g. "1m".
    Period,
    /// `{retry_after}`: whole seconds, as in `Retry-After`.
    RetryAfter,
}

impl Placeholder {
    const ALL: [(&'static str, Placeholder); 4] = [
        ("{policy}", Placeholder::Policy),
        ("{limit}", Placeholder::Limit),
        ("{period}", Placeholder::Period),
        ("{retry_after}", Placeholder::RetryAfter),
    ];
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    Value(Placeholder),
}

/// A body split into literal text and placeholders. Any other `{...}` (JSON's own braces)
/// is text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Template {
    pub parts: Vec<Part>,
    /// Bytes of literal text in all: a rendering's capacity.
    text_len: usize,
}

impl Template {
    pub fn parse(body: &str) -> Template {
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = body;
        while let Some(open) = rest.find('{') {
            text.push_str(&rest[..open]);
            rest = &rest[open..];
            match Placeholder::ALL
                .iter()
                .find(|(name, _)| rest.starts_with(name))
            {
                Some((name, which)) => {
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(Part::Value(*which));
                    rest = &rest[name.len()..];
                }
                None => {
                    text.push('{');
                    rest = &rest[1..];
                }
            }
        }
        text.push_str(rest);
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let text_len = parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.len(),
                Part::Value(_) => 0,
            })
            .sum();
        Template { parts, text_len }
    }

    /// The body with every placeholder replaced.
    pub fn render(&self, policy: &str, limit: u64, period: &str, retry_after: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.text_len + 64);
        let mut number = itoa::Buffer::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.extend_from_slice(t.as_bytes()),
                Part::Value(Placeholder::Policy) => out.extend_from_slice(policy.as_bytes()),
                Part::Value(Placeholder::Limit) => {
                    out.extend_from_slice(number.format(limit).as_bytes())
                }
                Part::Value(Placeholder::Period) => out.extend_from_slice(period.as_bytes()),
                Part::Value(Placeholder::RetryAfter) => {
                    out.extend_from_slice(number.format(retry_after).as_bytes())
                }
            }
        }
        out
    }
}

/// A policy's `reject`: its 429 body and that body's content type.
#[derive(Debug, Clone)]
pub struct Reject {
    pub body: Template,
    pub content_type: String,
    /// The period as written (`{period}`); empty for a concurrency policy without one.
    pub period: String,
    /// `body_file` as written, and where: read by `read_bodies` once every policy is known.
    file: Spanned<String>,
}

/// `reject = { body_file = "...", content_type = "..." }` of the policy table `t`; the file
/// itself is read by `read_bodies`.
pub(super) fn reject(p: &Problems, t: &Table, policy: &str) -> Option<Reject> {
    let node = t.get("reject")?;
    let o = Table::new(p, &format!("`reject` of [policies.{policy}]"), node)?;
    let file = o.required("body_file").and_then(|_| o.string("body_file"));
    let content_type = o
        .string("content_type")
        .map_or_else(|| DEFAULT_CONTENT_TYPE.to_owned(), |s| s.value);
    if content_type.is_empty() || content_type.chars().any(|c| c.is_control()) {
        p.at(
            &o.key_span("content_type"),
            "`content_type` must be a non-empty header value",
        );
    }
    o.finish();
    let period = match t.get("period").map(|n| &n.value) {
        Some(Node::Str(s)) => s.clone(),
        _ => String::new(),
    };
    Some(Reject {
        body: Template::default(),
        content_type,
        period,
        file: file?,
    })
}

/// Reads every policy's `reject` body (relative paths from the config's directory, as
/// certificates are); a file that cannot be read is a problem at its `body_file`.
pub(super) fn read_bodies<'a>(
    p: &Problems,
    rejects: impl Iterator<Item = &'a mut Reject>,
    dir: &Path,
) {
    for reject in rejects {
        let path = dir.join(&reject.file.value);
        match std::fs::read(&path) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => reject.body = Template::parse(&text),
                Err(_) => at(p, &reject.file.span, &path, "not UTF-8 text"),
            },
            Err(e) => at(p, &reject.file.span, &path, &e.to_string()),
        }
    }
}

fn at(p: &Problems, span: &Range<usize>, path: &Path, why: &str) {
    p.at(
        span,
        format!("`body_file`: cannot read {}: {why}", path.display()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_split_once_and_other_braces_kept() {
        let t = Template::parse(
            "{\"error\":{\"policy\":\"{policy}\",\"limit\":{limit},\"period\":\"{period}\",\"retry\":{retry_after}},\"x\":\"{nope}\"}",
        );
        assert_eq!(
            t.parts
                .iter()
                .filter(|p| matches!(p, Part::Value(_)))
                .count(),
            4
        );
        let body = t.render("per_key", 100, "1m", 17);
        assert_eq!(
            String::from_utf8(body).expect("utf-8"),
            "{\"error\":{\"policy\":\"per_key\",\"limit\":100,\"period\":\"1m\",\"retry\":17},\"x\":\"{nope}\"}"
        );
    }

    #[test]
    fn text_without_placeholders_is_one_part() {
        assert_eq!(
            Template::parse("slow down {").parts,
            vec![Part::Text("slow down {".into())]
        );
        assert!(Template::parse("").parts.is_empty());
        assert_eq!(
            Template::parse("{retry_after}{retry_after}").render("p", 1, "1s", 3),
            b"33"
        );
    }
}
