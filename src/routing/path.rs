//! One path, one spelling (DESIGN §17): the normal form of a request path, which routes,
//! keys and the upstream all see, so that no other spelling of a path can reach a route's
//! upstream past the route's own rules; and the form routes match it in (DESIGN §21), as
//! the most lenient upstream reads it.

use std::borrow::Cow;

use crate::config::EscapedSlashes;

/// Why a path has no normal form: the request is refused with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// A `..` segment would climb above `/`.
    AboveRoot,
    /// `%2F` or `%5C` with `escaped_slashes = "reject"`.
    EscapedSlash,
    /// A raw `\`: not a URI character, and read as `/` by Node, browsers and IIS.
    Backslash,
}

impl PathError {
    /// The `detail` of the 400 answer.
    pub fn detail(self) -> &'static str {
        match self {
            PathError::AboveRoot => "the path climbs above the root with `..`",
            PathError::EscapedSlash => "the path holds an encoded slash or backslash (%2F, %5C)",
            PathError::Backslash => "the path holds a backslash, which is not a URI character",
        }
    }
}

/// The normal form of `path` (the path of a request target, without its query):
/// percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) decoded, the hex digits
/// of every other escape upper-cased (RFC 3986 6.2.2.1), a `%` that starts no escape
/// written `%25`, dot segments removed (RFC 3986 5.2.4), and with `merge_slashes` repeated
/// slashes merged. An encoded slash or backslash is never decoded: it is kept, or refused
/// with `EscapedSlashes::Reject`; a raw backslash is always refused (DESIGN §21). A path
/// that does not start with `/` (`*`, a CONNECT authority) is not a path to normalise and
/// comes back as it is.
///
/// A path that is already normal (no `%`, no dot segment, no `//` when merging) is
/// borrowed, not copied.
pub fn normalize_path(
    path: &str,
    merge_slashes: bool,
    escaped_slashes: EscapedSlashes,
) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') || is_normal(path.as_bytes(), merge_slashes) {
        return Ok(Cow::Borrowed(path));
    }
    if path.contains('\\') {
        return Err(PathError::Backslash);
    }
    if escaped_slashes == EscapedSlashes::Reject && has_escaped_slash(path.as_bytes()) {
        return Err(PathError::EscapedSlash);
    }
    let decoded = decode_unreserved(path);
    remove_dot_segments(&decoded, merge_slashes).map(Cow::Owned)
}

/// Whether `path` (starting with `/`) is its own normal form and holds no `%` and no `\`:
/// one pass, no allocation.
fn is_normal(path: &[u8], merge_slashes: bool) -> bool {
    let mut start = 1;
    for i in 1..=path.len() {
        match path.get(i) {
            Some(b'%' | b'\\') => return false,
            Some(b'/') | None => {
                let segment = &path[start..i];
                let last = i == path.len();
                if segment == b"."
                    || segment == b".."
                    || (merge_slashes && !last && segment.is_empty())
                {
                    return false;
                }
                start = i + 1;
            }
            Some(_) => {}
        }
    }
    true
}

/// `%2F`, `%2f`, `%5C` or `%5c` anywhere in `path`.
fn has_escaped_slash(path: &[u8]) -> bool {
    path.windows(3).any(|w| {
        w[0] == b'%'
            && matches!(
                (w[1], w[2].to_ascii_uppercase()),
                (b'2', b'F') | (b'5', b'C')
            )
    })
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986 2.3: the characters an escape never needs to hide.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// `path` with the escapes of unreserved characters decoded, every other escape's hex
/// digits upper-cased, and a `%` that starts no escape written `%25` (so that no escape
/// can be formed out of what was decoded: `%%34%31` is `%2541`, never `%41`).
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len() + 8);
    // Bytes from `copied` to `i` are written as they are; `%` is ASCII, so every index
    // where one is found is a char boundary.
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            i += 1;
            continue;
        }
        out.push_str(&path[copied..i]);
        let escape = bytes.get(i + 1).zip(bytes.get(i + 2));
        match escape.and_then(|(&h, &l)| Some(hex_value(h)? << 4 | hex_value(l)?)) {
            Some(value) if is_unreserved(value) => {
                out.push(char::from(value));
                i += 3;
            }
            Some(_) => {
                out.push('%');
                out.push(char::from(bytes[i + 1].to_ascii_uppercase()));
                out.push(char::from(bytes[i + 2].to_ascii_uppercase()));
                i += 3;
            }
            None => {
                out.push_str("%25");
                i += 1;
            }
        }
        copied = i;
    }
    out.push_str(&path[copied..]);
    out
}

/// RFC 3986 5.2.4 on a path starting with `/`: `.` segments dropped, each `..` removes the
/// segment before it (none left: the path climbs above the root), and a path ending in a
/// dot segment ends with `/`. With `merge_slashes`, empty segments are dropped too, except
/// a trailing one (`/a/` keeps its slash).
fn remove_dot_segments(path: &str, merge_slashes: bool) -> Result<String, PathError> {
    let mut out = String::with_capacity(path.len());
    let mut segments = path[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match segment {
            "." => {}
            ".." => match out.rfind('/') {
                Some(at) => out.truncate(at),
                None => return Err(PathError::AboveRoot),
            },
            "" if merge_slashes && !last => continue,
            _ => {
                out.push('/');
                out.push_str(segment);
                continue;
            }
        }
        if last {
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// The form routes match a normal path in (DESIGN §21): each segment's `;parameters`
/// removed, as servlet containers do before mapping, and the dot segments that uncovers
/// removed again (`/static/..;/admin` is `/admin`, never above the root); with
/// `case_insensitive`, in ASCII lower case. Only matching reads it: keys and the upstream
/// get the normal form, parameters kept. A path with neither is borrowed, not copied.
pub fn match_form(path: &str, case_insensitive: bool) -> Cow<'_, str> {
    let mut form = if path.starts_with('/') && path.contains(';') {
        Cow::Owned(without_parameters(path))
    } else {
        Cow::Borrowed(path)
    };
    if case_insensitive && form.bytes().any(|b| b.is_ascii_uppercase()) {
        form.to_mut().make_ascii_lowercase();
    }
    form
}

/// `path` (starting with `/`) with `;` to the end of each segment dropped and dot segments
/// removed, a `..` at the root staying there.
fn without_parameters(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut segments = path[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let name = segment.split_once(';').map_or(segment, |(name, _)| name);
        match name {
            "." => {}
            ".." => out.truncate(out.rfind('/').unwrap_or(0)),
            // Parameters alone are no segment: `/;/admin` is `/admin`, as Tomcat reads it.
            "" if name.len() < segment.len() && segments.peek().is_some() => continue,
            _ => {
                out.push('/');
                out.push_str(name);
                continue;
            }
        }
        if segments.peek().is_none() {
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn norm(path: &str) -> Result<String, PathError> {
        normalize_path(path, true, EscapedSlashes::Keep).map(Cow::into_owned)
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_only_those() {
        assert_eq!(norm("/%76%31/x").as_deref(), Ok("/v1/x"));
        assert_eq!(norm("/%41%7a%30%2D%2e%5F%7E").as_deref(), Ok("/Az0-._~"));
        assert_eq!(norm("/a%2fb%5cc%3f%20").as_deref(), Ok("/a%2Fb%5Cc%3F%20"));
        assert_eq!(norm("/%e2%82%ac").as_deref(), Ok("/%E2%82%AC"));
        // A `%` that starts no escape is written %25: nothing decoded can join it.
        assert_eq!(norm("/%zz/%4/%").as_deref(), Ok("/%25zz/%254/%25"));
        assert_eq!(norm("/%%34%31").as_deref(), Ok("/%2541"));
        assert_eq!(norm("/%%32F").as_deref(), Ok("/%252F"));
    }

    #[test]
    fn dot_segments_are_removed_and_slashes_merged() {
        for (raw, normal) in [
            ("/a/../v1/x", "/v1/x"),
            ("/v1/./x", "/v1/x"),
            ("//v1//x", "/v1/x"),
            ("/v1/x/", "/v1/x/"),
            ("/v1/x/.", "/v1/x/"),
            ("/v1/x/..", "/v1/"),
            ("/a/..", "/"),
            ("/.", "/"),
            ("//", "/"),
            ("/a/%2e%2E/", "/"),
            ("/a/%2e%2e/b", "/b"),
            ("/a/.../b", "/a/.../b"),
            ("/a/..b/.c", "/a/..b/.c"),
            // Slashes are merged first: `..` removes the segment before it, not an empty one.
            ("/a//../b", "/b"),
        ] {
            assert_eq!(norm(raw).as_deref(), Ok(normal), "{raw}");
        }
        let keep = |p| normalize_path(p, false, EscapedSlashes::Keep).map(Cow::into_owned);
        assert_eq!(keep("//v1//x").as_deref(), Ok("//v1//x"));
        assert_eq!(keep("/a/..//v1//./x//").as_deref(), Ok("//v1//x//"));
        assert_eq!(keep("/a//..").as_deref(), Ok("/a/"));
        assert_eq!(keep("/a//../b").as_deref(), Ok("/a/b"));
    }

    #[test]
    fn climbing_above_the_root_is_an_error() {
        for raw in ["/..", "/../x", "/a/../../x", "/%2e%2e/x", "/./..", "//../x"] {
            assert_eq!(norm(raw), Err(PathError::AboveRoot), "{raw}");
        }
        assert_eq!(
            normalize_path("/a//../../x", false, EscapedSlashes::Keep),
            Ok(Cow::Owned("/x".to_owned()))
        );
    }

    #[test]
    fn escaped_slashes_are_kept_or_refused() {
        let reject = |p| normalize_path(p, true, EscapedSlashes::Reject);
        for raw in ["/a%2Fb", "/a%2fb", "/a%5Cb", "/a%5c", "/%2F"] {
            assert_eq!(reject(raw), Err(PathError::EscapedSlash), "{raw}");
        }
        assert_eq!(reject("/a%2Eb").as_deref(), Ok("/a.b"));
        assert_eq!(reject("/a%252Fb").as_deref(), Ok("/a%252Fb"));
    }

    #[test]
    fn a_raw_backslash_is_refused() {
        for path in ["/admin\\users", "/static\\..\\admin\\users", "/a/%41\\"] {
            assert_eq!(norm(path), Err(PathError::Backslash), "{path}");
        }
    }

    #[test]
    fn routes_match_without_parameters_and_the_dots_they_hid() {
        let form = |p| match_form(p, false).into_owned();
        assert_eq!(form("/admin;x/users"), "/admin/users");
        assert_eq!(form("/static/..;/admin/users"), "/admin/users");
        assert_eq!(form("/login;jsessionid=N"), "/login");
        assert_eq!(form("/..;/..;/admin"), "/admin");
        assert_eq!(form("/a/b/..;"), "/a/");
        assert_eq!(form("/a;x/"), "/a/");
        assert_eq!(form("/;x"), "/");
        assert!(matches!(
            match_form("/admin/users", false),
            Cow::Borrowed(_)
        ));
        assert_eq!(match_form("/Admin;x/Users", true), "/admin/users");
        assert!(matches!(match_form("/admin/users", true), Cow::Borrowed(_)));
    }

    #[test]
    fn a_normal_path_is_borrowed() {
        for path in ["/", "/v1/x", "/v1/x/", "/a/.../b.c", "*", ""] {
            assert!(
                matches!(normalize_path(path, true, EscapedSlashes::Reject), Ok(Cow::Borrowed(p)) if p == path),
                "{path}"
            );
        }
        assert!(matches!(
            normalize_path("//x", false, EscapedSlashes::Keep),
            Ok(Cow::Borrowed(_))
        ));
        assert!(matches!(
            normalize_path("/%41", true, EscapedSlashes::Keep),
            Ok(Cow::Owned(_))
        ));
    }

    /// Each valid escape in `s`, decoded, in order.
    fn escapes(s: &str) -> Vec<u8> {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match (
                b[i],
                b.get(i + 1).copied().and_then(hex_value),
                b.get(i + 2).copied().and_then(hex_value),
            ) {
                (b'%', Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                }
                _ => i += 1,
            }
        }
        out
    }

    /// What the escapes of a path must become: those of characters that are not unreserved
    /// stay, and each `%` that starts no escape becomes `%25`.
    fn kept_escapes(s: &str) -> Vec<u8> {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match (
                b[i],
                b.get(i + 1).copied().and_then(hex_value),
                b.get(i + 2).copied().and_then(hex_value),
            ) {
                (b'%', Some(h), Some(l)) => {
                    if !is_unreserved(h << 4 | l) {
                        out.push(h << 4 | l);
                    }
                    i += 3;
                }
                (b'%', _, _) => {
                    out.push(b'%');
                    i += 1;
                }
                _ => i += 1,
            }
        }
        out
    }

    /// Paths made of what makes normalising hard: dots, slashes, escapes (of unreserved
    /// characters, of slashes, of `%`, broken ones), hex digits and other characters.
    fn hostile_path() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/".to_owned()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just("%".to_owned()),
            Just("%2e".to_owned()),
            Just("%2E".to_owned()),
            Just("%2f".to_owned()),
            Just("%5C".to_owned()),
            Just("%25".to_owned()),
            Just("%41".to_owned()),
            Just("%7e".to_owned()),
            Just("%e2%82%ac".to_owned()),
            "[0-9a-fA-F]",
            "%[0-9a-fA-F]{2}",
            "[a-z~_\\-:@!$&'()*+,;=]",
            "\\PC",
        ];
        prop::collection::vec(piece, 0..24).prop_map(|pieces| format!("/{}", pieces.concat()))
    }

    /// The same, without anything that is or decodes to a dot, and without a backslash.
    fn dotless_path() -> impl Strategy<Value = String> {
        hostile_path().prop_filter("no dots", |p| {
            !p.contains('.') && !p.to_ascii_uppercase().contains("%2E") && !p.contains('\\')
        })
    }

    /// A path of the pieces that lenient upstreams read their own way: `\\`, `;params`, dot
    /// segments, repeated slashes.
    fn lenient_path() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/"),
            Just("\\"),
            Just("."),
            Just(".."),
            Just(";"),
            Just(";x=1"),
            Just("admin"),
            Just("login"),
            Just("a"),
        ];
        prop::collection::vec(piece, 0..12).prop_map(|pieces| format!("/{}", pieces.concat()))
    }

    /// How the most lenient upstreams read a path (DESIGN §21): `\\` as `/` (Node, browsers,
    /// IIS), each segment's `;parameters` dropped and then its dot segments (servlet
    /// containers), empty segments merged.
    fn lenient_reading(path: &str) -> String {
        let mut out: Vec<&str> = Vec::new();
        let slashed = path.replace('\\', "/");
        let segments: Vec<&str> = slashed.split('/').skip(1).collect();
        for (i, segment) in segments.iter().enumerate() {
            match segment.split(';').next().unwrap_or_default() {
                "." => {}
                ".." => {
                    out.pop();
                }
                "" if i + 1 < segments.len() => {}
                s => out.push(s),
            }
        }
        format!("/{}", out.join("/"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Whatever a path's spelling, sluice either refuses it or matches it where the
        /// most lenient upstream reads the path sluice sends it (the normal form): a path
        /// that such an upstream reads under `/admin/` matches a `/admin/` prefix route, one
        /// it reads as `/login` (or `/login/`) matches an exact `/login` route; never the
        /// catch-all instead.
        #[test]
        fn no_spelling_walks_past_a_route(path in lenient_path()) {
            let Ok(normal) = normalize_path(&path, true, EscapedSlashes::Keep) else {
                return Ok(());
            };
            prop_assert!(!path.contains('\\'), "{} was not refused", path);
            let lenient = lenient_reading(&normal);
            let form = match_form(&normal, false);
            if lenient.starts_with("/admin/") {
                prop_assert!(form.starts_with("/admin/"), "{} read as {} matched as {}", path, lenient, form);
            }
            if lenient == "/login" || lenient == "/login/" {
                prop_assert!(form == "/login" || form == "/login/", "{} read as {} matched as {}", path, lenient, form);
            }
        }

        #[test]
        fn normalised_twice_is_normalised_once(path in hostile_path(), merge in any::<bool>()) {
            if let Ok(once) = normalize_path(&path, merge, EscapedSlashes::Keep) {
                let twice = normalize_path(&once, merge, EscapedSlashes::Keep);
                prop_assert_eq!(twice.as_deref(), Ok(once.as_ref()));
                if !once.contains('%') {
                    prop_assert!(matches!(twice, Ok(Cow::Borrowed(_))), "not borrowed: {}", once);
                }
            }
        }

        #[test]
        fn the_result_never_climbs_above_the_root(path in hostile_path(), merge in any::<bool>()) {
            if let Ok(normal) = normalize_path(&path, merge, EscapedSlashes::Keep) {
                prop_assert!(normal.starts_with('/'), "{}", normal);
                for segment in normal[1..].split('/') {
                    prop_assert!(segment != "." && segment != "..", "{} from {}", normal, path);
                }
                if merge {
                    prop_assert!(!normal.contains("//"), "{} from {}", normal, path);
                }
            }
        }

        #[test]
        fn only_unreserved_characters_are_decoded(path in hostile_path(), merge in any::<bool>()) {
            if let Ok(normal) = normalize_path(&path, merge, EscapedSlashes::Keep) {
                // No escape of an unreserved character is left, and every escape left is
                // upper-case.
                for value in escapes(&normal) {
                    prop_assert!(!is_unreserved(value), "{} from {}", normal, path);
                }
                prop_assert!(!normal.contains('%') || {
                    let b = normal.as_bytes();
                    b.iter().enumerate().filter(|(_, &c)| c == b'%').all(|(i, _)| {
                        b.get(i + 1..i + 3).is_some_and(|h| h.iter().all(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(c)))
                    })
                }, "{}", normal);
            }
        }

        #[test]
        fn no_other_escape_is_decoded(path in dotless_path()) {
            // Without dot segments and slash merging nothing is removed, so every escape
            // of a character that is not unreserved must still be there, in order.
            let normal = normalize_path(&path, false, EscapedSlashes::Keep);
            prop_assert!(normal.is_ok());
            if let Ok(normal) = normal {
                prop_assert_eq!(escapes(&normal), kept_escapes(&path), "{} from {}", normal, path);
            }
        }

        #[test]
        fn reject_refuses_exactly_the_paths_with_escaped_slashes(path in hostile_path()) {
            let kept = normalize_path(&path, true, EscapedSlashes::Keep);
            let rejected = normalize_path(&path, true, EscapedSlashes::Reject);
            if path.contains('\\') {
                prop_assert_eq!(rejected, Err(PathError::Backslash));
                prop_assert_eq!(kept, Err(PathError::Backslash));
            } else if has_escaped_slash(path.as_bytes()) {
                prop_assert_eq!(rejected, Err(PathError::EscapedSlash));
            } else {
                prop_assert_eq!(rejected, kept);
            }
        }

        #[test]
        fn the_match_form_has_no_parameters_and_never_climbs(path in hostile_path()) {
            if let Ok(normal) = normalize_path(&path, false, EscapedSlashes::Keep) {
                let form = match_form(&normal, false);
                prop_assert!(form.starts_with('/'), "{} from {}", form, normal);
                prop_assert!(!form.contains(';'), "{} from {}", form, normal);
                for segment in form[1..].split('/') {
                    prop_assert!(segment != "." && segment != "..", "{} from {}", form, normal);
                }
            }
        }

        #[test]
        fn any_string_is_an_answer_never_a_panic(path in "\\PC*", merge in any::<bool>()) {
            let _ = normalize_path(&path, merge, EscapedSlashes::Reject);
            let _ = normalize_path(&format!("/{path}"), merge, EscapedSlashes::Keep);
        }
    }
}
