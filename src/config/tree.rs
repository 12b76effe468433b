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
    /// A TOML float (or an integer beyond i64, as infinity: no key takes such a number).
    Float(f64),
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
            Node::Float(_) => "a float",
            Node::Datetime => "a datetime",
            Node::Array(_) => "an array",
            Node::Table(_) => "a table",
        }
    }
}

/// Parses TOML text into the spanned tree; a syntax error comes back with its byte offset.
pub fn parse(text: &str) -> Result<Spanned<Node>, (usize, String)> {
    let doc = toml::de::DeTable::parse(text).map_err(|e| {
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
        value: table(doc.get_ref()),
        span: 0..0,
    })
}

fn table(t: &toml::de::DeTable) -> Node {
    Node::Table(
        t.iter()
            .map(|(k, v)| {
                (
                    Spanned {
                        value: k.get_ref().to_string(),
                        span: k.span(),
                    },
                    value_of(v),
                )
            })
            .collect(),
    )
}

fn value_of(v: &toml::Spanned<toml::de::DeValue>) -> Spanned<Node> {
    use toml::de::DeValue;
    let value = match v.get_ref() {
        DeValue::String(s) => Node::Str(s.to_string()),
        DeValue::Integer(i) => match i64::from_str_radix(i.as_str(), i.radix()) {
            Ok(n) => Node::Int(n),
            // Out of i64's range: no key takes such a number.
            Err(_) => Node::Float(f64::INFINITY),
        },
        DeValue::Float(f) => Node::Float(f.as_str().replace('_', "").parse().unwrap_or(f64::NAN)),
        DeValue::Boolean(b) => Node::Bool(*b),
        DeValue::Datetime(_) => Node::Datetime,
        DeValue::Array(a) => Node::Array(a.iter().map(value_of).collect()),
        DeValue::Table(t) => table(t),
    };
    Spanned {
        value,
        span: v.span(),
    }
}
