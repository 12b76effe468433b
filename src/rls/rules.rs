//! Matching a request's descriptors against a domain's rule tree (read from
//! envoyproxy/ratelimit's YAML by `config`): the most specific descriptor at each level wins.

pub use crate::config::ratelimit::{Descriptor, Domain, Limit, Shape};

/// The rule a request descriptor's entries reach, as envoyproxy/ratelimit finds it: at each
/// level an exact `key`+`value` first, then a `value` prefix (`*`), then the `key` alone; the
/// rule applies only when the last entry lands on it.
pub fn find<'a>(domain: &'a Domain, entries: &[(&str, &str)]) -> Option<&'a Limit> {
    let mut level = &domain.descriptors;
    for (i, (key, value)) in entries.iter().enumerate() {
        let same_key = level.iter().filter(|d| d.key == *key);
        let next = same_key
            .clone()
            .find(|d| !d.prefix && d.value.as_deref() == Some(value))
            .or_else(|| {
                same_key
                    .clone()
                    .find(|d| d.prefix && d.value.as_deref().is_some_and(|p| value.starts_with(p)))
            })
            .or_else(|| same_key.clone().find(|d| d.value.is_none()))?;
        if i + 1 == entries.len() {
            return next.limit.as_ref();
        }
        if next.descriptors.is_empty() {
            return None;
        }
        level = &next.descriptors;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ratelimit::{parse, rules};
    use crate::config::Algorithm;
    use std::time::Duration;

    const EXAMPLE: &str = "\
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500
  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: path
    value: /api/*
    rate_limit:
      name: api
      unit: hour
      requests_per_unit: 7
  - key: generic_key
    value: nested
    descriptors:
      - key: user
        rate_limit:
          unit: MINUTE
          requests_per_unit: 3
          algorithm: gcra
          burst: 5
          ban: 1m
        shadow_mode: true
        replaces:
          - name: api
";

    fn name_of(d: &Domain, entries: &[(&str, &str)]) -> Option<String> {
        find(d, entries).map(|l| l.name.clone())
    }

    #[test]
    fn matches_the_most_specific_descriptor() {
        let d = parse("x.yaml", EXAMPLE).expect("valid");
        assert_eq!(d.name, "mongo_cps");
        assert_eq!(
            name_of(&d, &[("database", "users")]).as_deref(),
            Some("database_users")
        );
        assert_eq!(name_of(&d, &[("database", "other")]), None);
        assert_eq!(
            name_of(&d, &[("remote_address", "10.0.0.1")]).as_deref(),
            Some("remote_address")
        );
        assert_eq!(name_of(&d, &[("path", "/api/v1")]).as_deref(), Some("api"));
        assert_eq!(name_of(&d, &[("path", "/other")]), None);
        // Depth must match: a parent without a limit, a request longer than the tree.
        assert_eq!(name_of(&d, &[("generic_key", "nested")]), None);
        assert_eq!(
            name_of(&d, &[("generic_key", "nested"), ("user", "bob")]).as_deref(),
            Some("generic_key_nested.user")
        );
        assert_eq!(
            name_of(&d, &[("remote_address", "a"), ("user", "bob")]),
            None
        );
        let nested = find(&d, &[("generic_key", "nested"), ("user", "bob")]).expect("rule");
        assert!(nested.shadow);
        assert_eq!(nested.replaces, vec!["api".to_owned()]);
        assert_eq!(
            nested.shape,
            Shape::Limited {
                requests_per_unit: 3,
                unit: Duration::from_secs(60),
                algorithm: Algorithm::Gcra,
                burst: Some(5),
                ban: Duration::from_secs(60),
                prefetch: None,
            }
        );
        assert_eq!(rules(&d).len(), 5);
    }

    #[test]
    fn an_exact_value_wins_over_a_prefix_and_a_prefix_over_any() {
        let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, name: any}\n  - key: k\n    value: ab*\n    rate_limit: {unit: second, requests_per_unit: 1, name: prefix}\n  - key: k\n    value: abc\n    rate_limit: {unit: second, requests_per_unit: 1, name: exact}\n";
        let d = parse("x.yaml", text).expect("valid");
        assert_eq!(name_of(&d, &[("k", "abc")]).as_deref(), Some("exact"));
        assert_eq!(name_of(&d, &[("k", "abd")]).as_deref(), Some("prefix"));
        assert_eq!(name_of(&d, &[("k", "x")]).as_deref(), Some("any"));
    }
}
