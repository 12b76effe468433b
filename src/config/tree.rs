//! A spanned, uniform view of a parsed TOML document, so validation can point at any key or value.

use std::ops::Range;

/// A value with the byte range it came from.
#[derive(Debug, Clone)]
pub struct Spanned<T> {
    pub value: T,
    pub span: Range<usize>,
}

#[derive(Debug, Clone)]
pub enum Node {
    Str(String),
    Int(i64),
    Bool(bool),
    Float,
    Datetime,
    Array(Vec<Spanned<Node>>),
    /// Tables and inline tables alike; keys keep their own spans.
    Table(Vec<(Spanned<String>, Spanned<Node>)>),
}

impl Node {
    pub fn kind(&self) -> &'static str {
        match self {
            Node::Str(_) => "a string",
            Node::Int(_) => "an integer",
            Node::Bool(_) => "a boolean",
            Node::Float => "a float",
            Node::Datetime => "a datetime",
            Node::Array(_) => "an array",
            Node::Table(_) => "a table",
        }
    }
}

/// Parses TOML text into the spanned tree; a syntax error comes back with its byte offset.
pub fn parse(text: &str) -> Result<Spanned<Node>, (usize, String)> {
    let doc = toml_edit::Document::parse(text.to_owned()).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        let message = e.message().trim().to_owned();
        // Name the key: `[policies.a]` twice says only "duplicate key".
        let message = match text.get(span.clone()) {
            Some(key) if message == "duplicate key" && !key.is_empty() => {
                format!("duplicate key `{key}`")
            }
            _ => message,
        };
        (span.start, message)
    })?;
    Ok(Spanned {
        value: table(doc.as_table()),
        span: 0..0,
    })
}

fn table(t: &toml_edit::Table) -> Node {
    Node::Table(
        t.iter()
            .filter_map(|(k, item)| {
                let (key, _) = t.get_key_value(k)?;
                Some((key_of(key), item_of(item)?))
            })
            .collect(),
    )
}

fn key_of(key: &toml_edit::Key) -> Spanned<String> {
    Spanned {
        value: key.get().to_owned(),
        span: key.span().unwrap_or(0..0),
    }
}

fn item_of(item: &toml_edit::Item) -> Option<Spanned<Node>> {
    match item {
        toml_edit::Item::None => None,
        toml_edit::Item::Value(v) => Some(value_of(v)),
        toml_edit::Item::Table(t) => Some(Spanned {
            value: table(t),
            span: t.span().unwrap_or(0..0),
        }),
        toml_edit::Item::ArrayOfTables(a) => Some(Spanned {
            value: Node::Array(
                a.iter()
                    .map(|t| Spanned {
                        value: table(t),
                        span: t.span().unwrap_or(0..0),
                    })
                    .collect(),
            ),
            span: a.span().unwrap_or(0..0),
        }),
    }
}

fn value_of(v: &toml_edit::Value) -> Spanned<Node> {
    let span = v.span().unwrap_or(0..0);
    let value = match v {
        toml_edit::Value::String(s) => Node::Str(s.value().clone()),
        toml_edit::Value::Integer(i) => Node::Int(*i.value()),
        toml_edit::Value::Float(_) => Node::Float,
        toml_edit::Value::Boolean(b) => Node::Bool(*b.value()),
        toml_edit::Value::Datetime(_) => Node::Datetime,
        toml_edit::Value::Array(a) => Node::Array(a.iter().map(value_of).collect()),
        toml_edit::Value::InlineTable(t) => Node::Table(
            t.iter()
                .filter_map(|(k, _)| {
                    let (key, item) = t.get_key_value(k)?;
                    Some((key_of(key), item_of(item)?))
                })
                .collect(),
        ),
    };
    Spanned { value, span }
}
