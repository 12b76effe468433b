//! envoyproxy/ratelimit's YAML (one domain per file), read unchanged into a rule tree with
//! located errors: plain data; `rls::rules` matches descriptors against it.

use std::time::Duration;

use saphyr::{LoadableYamlNode, MarkedYaml, Scalar, YamlData};

use super::policies::{Algorithm, Prefetch};
use super::read::{parse_duration, ConfigError};

/// One domain: its descriptor tree.
#[derive(Debug, Clone)]
pub struct Domain {
    pub name: String,
    pub descriptors: Vec<Descriptor>,
}

/// One level of the tree: `key`, and `value` (None: any value; `prefix`: a trailing `*`).
#[derive(Debug, Clone)]
pub struct Descriptor {
    pub key: String,
    pub value: Option<String>,
    pub prefix: bool,
    pub limit: Option<Limit>,
    pub descriptors: Vec<Descriptor>,
}

/// A descriptor's `rate_limit`, with where it was written (for errors found later).
#[derive(Debug, Clone)]
pub struct Limit {
    /// `name`, else the descriptor path (`key_value.key`): the policy's name.
    pub name: String,
    pub shape: Shape,
    pub shadow: bool,
    pub replaces: Vec<String>,
    pub at: ConfigError,
    /// Set by the config: the policy this rule is counted as (none when unlimited).
    pub policy: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    Unlimited,
    /// `requests_per_unit: 0` refuses every request (no policy counts it).
    Limited {
        requests_per_unit: u64,
        unit: Duration,
        algorithm: Algorithm,
        burst: Option<u64>,
        ban: Duration,
        /// `prefetch: { max, hold }` (DESIGN §19), as the TOML's.
        prefetch: Option<Prefetch>,
    },
}

/// The unit names of envoyproxy/ratelimit (case-insensitive there too) and their length
/// (its month is 30 days, its year 365).
const UNITS: &[(&str, u64)] = &[
    ("second", 1),
    ("minute", 60),
    ("hour", 3_600),
    ("day", 86_400),
    ("week", 7 * 86_400),
    ("month", 30 * 86_400),
    ("year", 365 * 86_400),
];

/// Every rule of `domain`, depth first, with the keys of its descriptor path.
pub fn rules(domain: &Domain) -> Vec<(Vec<String>, &Limit)> {
    fn walk<'a>(
        level: &'a [Descriptor],
        keys: &mut Vec<String>,
        out: &mut Vec<(Vec<String>, &'a Limit)>,
    ) {
        for d in level {
            keys.push(d.key.clone());
            if let Some(limit) = &d.limit {
                out.push((keys.clone(), limit));
            }
            walk(&d.descriptors, keys, out);
            keys.pop();
        }
    }
    let mut out = Vec::new();
    walk(&domain.descriptors, &mut Vec::new(), &mut out);
    out
}

/// Every rule of `domain`, mutably (to set `policy`), in the order of `rules`.
pub fn limits_mut(domain: &mut Domain) -> Vec<&mut Limit> {
    fn walk<'a>(level: &'a mut [Descriptor], out: &mut Vec<&'a mut Limit>) {
        for d in level {
            if let Some(limit) = &mut d.limit {
                out.push(limit);
            }
            walk(&mut d.descriptors, out);
        }
    }
    let mut out = Vec::new();
    walk(&mut domain.descriptors, &mut out);
    out
}

/// Reads one YAML file of `file` (its name, for messages): its domain, or every problem.
pub fn parse(file: &str, text: &str) -> Result<Domain, Vec<ConfigError>> {
    let docs = MarkedYaml::load_from_str(text).map_err(|e| {
        vec![ConfigError {
            file: file.to_owned(),
            line: e.marker().line(),
            col: e.marker().col() + 1,
            message: format!("bad YAML: {}", e.info()),
        }]
    })?;
    let mut r = Reader {
        file,
        errors: Vec::new(),
    };
    let domain = match docs.as_slice() {
        [doc] => r.domain(doc),
        [] => {
            r.at_start("empty file: expected a `domain` and its `descriptors`");
            None
        }
        [_, extra, ..] => {
            r.at(extra, "one YAML document per file");
            None
        }
    };
    match domain {
        Some(d) if r.errors.is_empty() => Ok(d),
        _ => Err(r.errors),
    }
}

struct Reader<'f> {
    file: &'f str,
    errors: Vec<ConfigError>,
}

type Entries<'n, 'i> = Vec<(&'n MarkedYaml<'i>, &'n str, &'n MarkedYaml<'i>)>;

impl Reader<'_> {
    fn located(&self, node: &MarkedYaml, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            line: node.span.start.line(),
            col: node.span.start.col() + 1,
            message: message.into(),
        }
    }

    fn at(&mut self, node: &MarkedYaml, message: impl Into<String>) {
        let e = self.located(node, message);
        self.errors.push(e);
    }

    fn at_start(&mut self, message: &str) {
        self.errors.push(ConfigError {
            file: self.file.to_owned(),
            line: 1,
            col: 1,
            message: message.to_owned(),
        });
    }

    /// A mapping's entries with string keys; every key not in `known` is reported.
    fn mapping<'n, 'i>(
        &mut self,
        node: &'n MarkedYaml<'i>,
        what: &str,
        known: &[&str],
    ) -> Option<Entries<'n, 'i>> {
        let YamlData::Mapping(map) = &node.data else {
            self.at(node, format!("{what} must be a mapping"));
            return None;
        };
        let mut out = Vec::new();
        for (k, v) in map {
            match &k.data {
                YamlData::Value(Scalar::String(s)) if known.contains(&s.as_ref()) => {
                    out.push((k, s.as_ref(), v))
                }
                YamlData::Value(Scalar::String(s)) => {
                    self.at(k, format!("unknown key `{s}` in {what}"))
                }
                _ => self.at(k, format!("keys of {what} must be strings")),
            }
        }
        Some(out)
    }

    /// A scalar as text, as Go's YAML reads one into a string field (`value: 8080` is "8080").
    fn text(&mut self, node: &MarkedYaml, key: &str) -> Option<String> {
        match &node.data {
            YamlData::Value(Scalar::String(s)) => Some(s.to_string()),
            YamlData::Value(Scalar::Integer(i)) => Some(i.to_string()),
            YamlData::Value(Scalar::Boolean(b)) => Some(b.to_string()),
            YamlData::Value(Scalar::FloatingPoint(f)) => Some(f.to_string()),
            _ => {
                self.at(node, format!("`{key}` must be a string"));
                None
            }
        }
    }

    /// A duration as the TOML writes one ("250ms", "10m"); `example` shows one in the error.
    fn duration(&mut self, node: &MarkedYaml, key: &str, example: &str) -> Option<Duration> {
        let text = self.text(node, key)?;
        let d = parse_duration(&text);
        if d.is_none() {
            self.at(node, format!("`{key}`: bad duration \"{text}\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"{example}\")"));
        }
        d
    }

    fn bool(&mut self, node: &MarkedYaml, key: &str) -> Option<bool> {
        match &node.data {
            YamlData::Value(Scalar::Boolean(b)) => Some(*b),
            _ => {
                self.at(node, format!("`{key}` must be true or false"));
                None
            }
        }
    }

    /// An integer from `min` to 2^53 (exact in Redis's Lua doubles, as the TOML's limits).
    fn integer(&mut self, node: &MarkedYaml, key: &str, min: i64) -> Option<u64> {
        match &node.data {
            YamlData::Value(Scalar::Integer(i)) if (min..=1 << 53).contains(i) => Some(*i as u64),
            YamlData::Value(Scalar::Integer(i)) => {
                self.at(
                    node,
                    format!("`{key}` must be between {min} and 9007199254740992, found {i}"),
                );
                None
            }
            _ => {
                self.at(node, format!("`{key}` must be an integer"));
                None
            }
        }
    }

    fn domain(&mut self, doc: &MarkedYaml) -> Option<Domain> {
        let entries = self.mapping(doc, "the file", &["domain", "descriptors"])?;
        let mut name = None;
        let mut descriptors = Vec::new();
        for (_, key, value) in entries {
            match key {
                "domain" => match self.text(value, "domain") {
                    Some(d) if d.is_empty() => self.at(value, "`domain` must not be empty"),
                    d => name = d,
                },
                _ => descriptors = self.descriptors(value, &[]).unwrap_or_default(),
            }
        }
        if name.is_none() && self.errors.is_empty() {
            self.at(doc, "missing required key `domain`");
        }
        Some(Domain {
            name: name?,
            descriptors,
        })
    }

    /// A `descriptors` list under the path `path` (the `key_value` names above it).
    fn descriptors(&mut self, node: &MarkedYaml, path: &[String]) -> Option<Vec<Descriptor>> {
        if matches!(node.data, YamlData::Value(Scalar::Null)) {
            return Some(Vec::new());
        }
        let YamlData::Sequence(items) = &node.data else {
            self.at(node, "`descriptors` must be a list");
            return None;
        };
        let mut out: Vec<Descriptor> = Vec::new();
        for item in items {
            let Some(d) = self.descriptor(item, path) else {
                continue;
            };
            let same = out
                .iter()
                .any(|o| o.key == d.key && o.value == d.value && o.prefix == d.prefix);
            if same {
                let shown = composite(&d);
                self.at(
                    item,
                    format!("duplicate descriptor `{shown}` at this level"),
                );
                continue;
            }
            out.push(d);
        }
        Some(out)
    }

    fn descriptor(&mut self, node: &MarkedYaml, path: &[String]) -> Option<Descriptor> {
        const KNOWN: &[&str] = &[
            "key",
            "value",
            "rate_limit",
            "descriptors",
            "shadow_mode",
            "replaces",
            "detailed_metric",
        ];
        let entries = self.mapping(node, "a descriptor", KNOWN)?;
        let find = |name: &str| entries.iter().find(|(_, k, _)| *k == name).map(|e| e.2);
        let key = match find("key").map(|k| (k, self.text(k, "key"))) {
            Some((_, Some(k))) if !k.is_empty() => k,
            Some((at, Some(_))) => {
                self.at(at, "`key` must not be empty");
                return None;
            }
            Some((_, None)) => return None,
            None => {
                self.at(node, "missing required key `key` in a descriptor");
                return None;
            }
        };
        let raw = find("value").and_then(|v| self.text(v, "value"));
        let (value, prefix) = match raw {
            Some(v) if v.ends_with('*') => (Some(v.trim_end_matches('*').to_owned()), true),
            Some(v) => (Some(v), false),
            None => (None, false),
        };
        let mut d = Descriptor {
            key,
            value,
            prefix,
            limit: None,
            descriptors: Vec::new(),
        };
        let mut here = path.to_vec();
        here.push(composite(&d));
        let shadow = find("shadow_mode")
            .and_then(|v| self.bool(v, "shadow_mode"))
            .unwrap_or(false);
        if let Some(v) = find("detailed_metric") {
            self.bool(v, "detailed_metric");
        }
        let replaces = match find("replaces") {
            Some(node) => self.replaces(node),
            None => Vec::new(),
        };
        if let Some(node) = find("rate_limit") {
            d.limit = self.rate_limit(node, &here, shadow, replaces);
        } else if !replaces.is_empty() {
            self.at(node, "`replaces` needs a `rate_limit` beside it");
        }
        if let Some(children) = find("descriptors") {
            d.descriptors = self.descriptors(children, &here).unwrap_or_default();
        }
        Some(d)
    }

    fn replaces(&mut self, node: &MarkedYaml) -> Vec<String> {
        let YamlData::Sequence(items) = &node.data else {
            self.at(node, "`replaces` must be a list of `name:` entries");
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in items {
            let Some(entries) = self.mapping(item, "a `replaces` entry", &["name"]) else {
                continue;
            };
            match entries.first().map(|e| (e.2, self.text(e.2, "name"))) {
                Some((_, Some(name))) if !name.is_empty() => out.push(name),
                Some((at, Some(_))) => self.at(at, "`name` must not be empty"),
                Some((_, None)) => {}
                None => self.at(item, "missing required key `name` in a `replaces` entry"),
            }
        }
        out
    }

    fn rate_limit(
        &mut self,
        node: &MarkedYaml,
        path: &[String],
        shadow: bool,
        replaces: Vec<String>,
    ) -> Option<Limit> {
        const KNOWN: &[&str] = &[
            "unit",
            "requests_per_unit",
            "unlimited",
            "name",
            "algorithm",
            "burst",
            "ban",
            "prefetch",
        ];
        let entries = self.mapping(node, "a `rate_limit`", KNOWN)?;
        let find = |name: &str| entries.iter().find(|(_, k, _)| *k == name).map(|e| e.2);
        let name = match find("name").map(|n| (n, self.text(n, "name"))) {
            Some((at, Some(n))) if n.is_empty() => {
                self.at(at, "`name` must not be empty");
                return None;
            }
            Some((_, Some(n))) => n,
            Some((_, None)) => return None,
            None => path.join("."),
        };
        let at = self.located(node, "");
        let unlimited = find("unlimited")
            .and_then(|v| self.bool(v, "unlimited"))
            .unwrap_or(false);
        let shape = if unlimited {
            Shape::Unlimited
        } else {
            let unit = match find("unit") {
                Some(v) => {
                    let text = self.text(v, "unit")?.to_ascii_lowercase();
                    match UNITS.iter().find(|(u, _)| *u == text) {
                        Some((_, secs)) => Duration::from_secs(*secs),
                        None => {
                            self.at(v, format!("`unit`: unknown value \"{text}\" (expected one of: second, minute, hour, day, week, month, year)"));
                            return None;
                        }
                    }
                }
                None => {
                    self.at(node, "missing required key `unit` in a `rate_limit`");
                    return None;
                }
            };
            let requests_per_unit = match find("requests_per_unit") {
                // 0 refuses every request, as envoyproxy/ratelimit does.
                Some(v) => self.integer(v, "requests_per_unit", 0)?,
                None => {
                    self.at(
                        node,
                        "missing required key `requests_per_unit` in a `rate_limit`",
                    );
                    return None;
                }
            };
            let algorithm = match find("algorithm") {
                Some(v) => {
                    let text = self.text(v, "algorithm")?;
                    let found = Algorithm::ALL
                        .into_iter()
                        // Envoy can only be told yes or no: not to wait, nor to hold a slot.
                        .filter(|a| !matches!(a, Algorithm::Concurrency | Algorithm::LeakyBucket))
                        .find(|a| a.name() == text);
                    match found {
                        Some(a) => a,
                        None => {
                            self.at(v, format!("`algorithm`: unknown value \"{text}\" (expected one of: fixed_window, sliding_window, sliding_log, token_bucket, gcra)"));
                            return None;
                        }
                    }
                }
                None => Algorithm::FixedWindow,
            };
            let burst = match find("burst") {
                Some(v) => Some(self.integer(v, "burst", 1)?),
                None => None,
            };
            // The rate algorithms' arithmetic in Redis's Lua (doubles) is exact while a count
            // times the period in ms stays below 2^53, as the TOML's policies require; the
            // windows and the log only count, so they take any limit up to 2^53.
            let rates = matches!(
                algorithm,
                Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Gcra
            );
            for (name, n) in [
                ("requests_per_unit", Some(requests_per_unit)),
                ("burst", burst),
            ] {
                if rates && n.is_some_and(|n| !super::policies::exact_in_redis(n, unit)) {
                    let at = find(name).unwrap_or(node);
                    self.at(at, format!("`{name}` times `unit` in ms must stay below 2^53 (9007199254740992) with {}, the exact range of Redis's numbers: use a shorter unit", algorithm.name()));
                }
            }
            let ban = match find("ban") {
                Some(v) => self.duration(v, "ban", "10m")?,
                None => Duration::ZERO,
            };
            let prefetch = match entries.iter().find(|(_, k, _)| *k == "prefetch") {
                Some((key, _, v)) => Some(self.prefetch(key, v, algorithm)?),
                None => None,
            };
            Shape::Limited {
                requests_per_unit,
                unit,
                algorithm,
                burst,
                ban,
                prefetch,
            }
        };
        Some(Limit {
            name,
            shape,
            shadow,
            replaces,
            at,
            policy: None,
        })
    }

    /// `prefetch: { max: N, hold: D }` beside `algorithm` (at `key`), with the TOML's rules:
    /// the window and bucket algorithms only, `max` at least 1, `hold` at least 1ms. Every
    /// problem in it is reported.
    fn prefetch(
        &mut self,
        key: &MarkedYaml,
        node: &MarkedYaml,
        algorithm: Algorithm,
    ) -> Option<Prefetch> {
        let entries = self.mapping(node, "`prefetch`", &["max", "hold"])?;
        let find = |name: &str| entries.iter().find(|(_, k, _)| *k == name).map(|e| e.2);
        let max = match find("max") {
            Some(v) => self.integer(v, "max", 1),
            None => {
                self.at(node, "missing required key `max` in `prefetch`");
                None
            }
        };
        let hold = match find("hold") {
            Some(v) => match self.duration(v, "hold", "250ms") {
                Some(d) if d.is_zero() => {
                    self.at(v, "`hold` must be at least 1ms");
                    None
                }
                d => d,
            },
            None => {
                self.at(node, "missing required key `hold` in `prefetch`");
                None
            }
        };
        // `algorithm` takes no concurrency or leaky_bucket here: a log is all that is left.
        if !matches!(
            algorithm,
            Algorithm::FixedWindow
                | Algorithm::SlidingWindow
                | Algorithm::TokenBucket
                | Algorithm::Gcra
        ) {
            self.at(
                key,
                format!("`prefetch` works with fixed_window, sliding_window, token_bucket and gcra, not {} (a log cannot be taken ahead)", algorithm.name()),
            );
            return None;
        }
        Some(Prefetch {
            max: max?,
            hold: hold?,
        })
    }
}

/// `key_value` (or `key` without a value), as envoyproxy/ratelimit names a descriptor.
fn composite(d: &Descriptor) -> String {
    match (&d.value, d.prefix) {
        (Some(v), true) => format!("{}_{v}*", d.key),
        (Some(v), false) => format!("{}_{v}", d.key),
        (None, _) => d.key.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        parse("r.yaml", text)
            .expect_err("invalid")
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn errors_are_located() {
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n"),
            ["r.yaml:5:13: `unit`: unknown value \"fortnight\" (expected one of: second, minute, hour, day, week, month, year)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    valu: x\n"),
            ["r.yaml:4:5: unknown key `valu` in a descriptor"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n  - key: k\n"),
            ["r.yaml:4:5: duplicate descriptor `k` at this level"]
        );
        assert_eq!(
            errors("descriptors: []\n"),
            ["r.yaml:1:1: missing required key `domain`"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n"),
            ["r.yaml:4:51: `requests_per_unit` must be between 0 and 9007199254740992, found -1"]
        );
        assert_eq!(
            errors("domain: d\n  descriptors: [\n"),
            ["r.yaml:2:14: bad YAML: mapping values are not allowed in this context"]
        );
    }

    #[test]
    fn counts_times_the_unit_stay_exact_in_redis() {
        let rule = |rpu: &str, extra: &str| {
            errors(&format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: year\n      requests_per_unit: {rpu}\n{extra}"))
        };
        // A year is 31,536,000,000 ms: 285,616 a year is the most that stays below 2^53;
        // a fixed window (the default) only counts, up to 2^53.
        for rule in [
            "{unit: year, requests_per_unit: 285616, algorithm: gcra}",
            "{unit: year, requests_per_unit: 9007199254740992}",
        ] {
            parse(
                "r.yaml",
                &format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {rule}\n"),
            )
            .expect("exact");
        }
        assert_eq!(
            rule("285617", "      algorithm: token_bucket\n"),
            ["r.yaml:6:26: `requests_per_unit` times `unit` in ms must stay below 2^53 (9007199254740992) with token_bucket, the exact range of Redis's numbers: use a shorter unit"]
        );
        assert_eq!(
            rule("10", "      algorithm: gcra\n      burst: 1000000\n"),
            ["r.yaml:8:14: `burst` times `unit` in ms must stay below 2^53 (9007199254740992) with gcra, the exact range of Redis's numbers: use a shorter unit"]
        );
    }

    #[test]
    fn prefetch_is_read_in_the_yamls_style() {
        let d = parse(
            "r.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 50000\n      algorithm: gcra\n      prefetch: { max: 256, hold: 250ms }\n  - key: j\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
        )
        .expect("valid");
        let prefetch = |i: usize| match &d.descriptors[i].limit.as_ref().expect("rule").shape {
            Shape::Limited { prefetch, .. } => *prefetch,
            Shape::Unlimited => panic!("limited"),
        };
        assert_eq!(
            prefetch(0),
            Some(Prefetch {
                max: 256,
                hold: Duration::from_millis(250)
            })
        );
        assert_eq!(prefetch(1), None);
    }

    #[test]
    fn prefetch_errors_are_located() {
        let rule = |algorithm: &str, prefetch: &str| {
            errors(&format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      algorithm: {algorithm}\n      prefetch: {prefetch}\n"))
        };
        assert_eq!(
            rule("sliding_log", "{ max: 16, hold: 1s }"),
            ["r.yaml:8:7: `prefetch` works with fixed_window, sliding_window, token_bucket and gcra, not sliding_log (a log cannot be taken ahead)"]
        );
        assert_eq!(
            rule("fixed_window", "{ max: 0, hold: 0ms, other: 1 }"),
            [
                "r.yaml:8:38: unknown key `other` in `prefetch`",
                "r.yaml:8:24: `max` must be between 1 and 9007199254740992, found 0",
                "r.yaml:8:33: `hold` must be at least 1ms",
            ]
        );
        assert_eq!(
            rule("gcra", "{ }"),
            [
                "r.yaml:8:17: missing required key `max` in `prefetch`",
                "r.yaml:8:17: missing required key `hold` in `prefetch`",
            ]
        );
        assert_eq!(
            rule("token_bucket", "{ max: many, hold: soon }"),
            [
                "r.yaml:8:24: `max` must be an integer",
                "r.yaml:8:36: `hold`: bad duration \"soon\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\")",
            ]
        );
        assert_eq!(
            rule("sliding_window", "256"),
            ["r.yaml:8:17: `prefetch` must be a mapping"]
        );
    }
}
