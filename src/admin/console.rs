//! The operator console (DESIGN §15): one page and its script and style, compiled into the
//! binary and served with a Content-Security-Policy that allows only these files and `/v1/`.
//! The page holds no data: everything it shows comes from `/v1/`, behind the admin token.

use http::Response;

/// No inline script or style, nothing from another origin, no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/app.js");
const STYLE: &str = include_str!("console/app.css");

/// The console's answer for `path`, or None when the path is not the console's.
pub fn serve(path: &str) -> Option<Response<Vec<u8>>> {
    let (content_type, body) = match path {
        "/console" | "/console/" => ("text/html; charset=utf-8", PAGE),
        "/console/app.js" => ("text/javascript; charset=utf-8", SCRIPT),
        "/console/app.css" => ("text/css; charset=utf-8", STYLE),
        _ => return None,
    };
    let response = Response::builder()
        .status(200)
        .header("Content-Type", content_type)
        .header("Content-Length", body.len())
        .header("Content-Security-Policy", CSP)
        .header("X-Content-Type-Options", "nosniff")
        .header("X-Frame-Options", "DENY")
        .header("Referrer-Policy", "no-referrer")
        .header("Cache-Control", "no-cache")
        .body(body.as_bytes().to_vec())
        .unwrap_or_default();
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_carry_the_policy_and_nothing_inline() {
        for path in ["/console", "/console/app.js", "/console/app.css"] {
            let r = serve(path).expect("served");
            assert_eq!(r.headers()["X-Content-Type-Options"], "nosniff");
            assert!(r.headers()["Content-Security-Policy"]
                .to_str()
                .is_ok_and(|p| p.contains("script-src 'self';")));
        }
        assert!(serve("/console/other.js").is_none());
        // The policy forbids inline script and style: the page must not need any.
        let page = PAGE.to_ascii_lowercase();
        assert!(!page.contains("<script>") && !page.contains(" style="));
        for tag in page.split('<').skip(1) {
            let tag = tag.split('>').next().unwrap_or("");
            assert!(
                !tag.split_whitespace().any(|a| a.starts_with("on")),
                "an inline handler in <{tag}>"
            );
        }
        assert!(!SCRIPT.contains("innerHTML") && !SCRIPT.contains("insertAdjacentHTML"));
    }
}
