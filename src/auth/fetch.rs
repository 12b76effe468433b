//! One HTTP(S) GET for a JWKS document, through Pingora's own client connector (its
//! rustls for https), so sluice carries no second HTTP client.

use bytes::BytesMut;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;

/// The body of a 200 answer to `GET url`, at most `max` bytes.
pub async fn get(url: &str, max: usize) -> Result<Vec<u8>, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let tls = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err("the URL must be http:// or https://".into()),
    };
    let host = uri.host().ok_or("the URL has no host")?.to_owned();
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let addr = tokio::net::lookup_host((host.trim_matches(['[', ']']), port))
        .await
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} has no address"))?;
    let peer = HttpPeer::new(addr, tls, host.clone());
    let connector = Connector::new(None);
    let (mut session, _) = connector
        .get_http_session(&peer)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = RequestHeader::build("GET", path.as_bytes(), None).map_err(|e| e.to_string())?;
    let authority = uri.authority().map_or(host.as_str(), |a| a.as_str());
    req.insert_header("Host", authority)
        .map_err(|e| e.to_string())?;
    req.insert_header("Accept", "application/json")
        .map_err(|e| e.to_string())?;
    req.insert_header("User-Agent", concat!("sluice/", env!("CARGO_PKG_VERSION")))
        .map_err(|e| e.to_string())?;
    session
        .write_request_header(Box::new(req))
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    session
        .finish_request_body()
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    session
        .read_response_header()
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = session.response_header().map_or(0, |r| r.status.as_u16());
    if status != 200 {
        return Err(format!("answered {status}"));
    }
    let mut body = BytesMut::new();
    while let Some(chunk) = session
        .read_response_body()
        .await
        .map_err(|e| format!("body cut: {e}"))?
    {
        if body.len() + chunk.len() > max {
            return Err(format!("document larger than {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.to_vec())
}
