//! Charging from the response (DESIGN §12, §17): the `metering` group of the context (the
//! charges a response settles), the meter that reads the tokens an LLM response reports as
//! its body passes, and settling the charges once the response is known.
//!
//! A whole JSON body is walked by a push scanner (`json`) that keeps only the object keys on
//! the current path (each at most `MAX_KEY` bytes, at most `MAX_DEPTH` deep) and the digits
//! of the number being read, skipping string values with memchr, so a body of any length is
//! read in a few hundred bytes. The crates considered (actson, struson) keep every string
//! token whole, a completion's text included.
//!
//! An SSE stream (`sse`) is read where the three formats put their usage: its first event
//! and its last events. The chunks between pass untouched, kept by reference while they are
//! among the last 64 KiB; the events read are framed there (each event's `data:` lines are
//! one JSON text) and scanned only if they hold a usage object. `decode` reads a body
//! through its Content-Encoding; `request` is the request side (the body read before the
//! decision, its bound, asking a stream for its usage).

pub mod decode;
mod json;
pub mod request;
mod sse;

use crate::config::UsageFormat;
use bytes::Bytes;
use json::{Found, Scanner, Slot, SLOTS};
use pingora::http::ResponseHeader;
use sse::Sse;

use crate::config::Metering as Metered;
use crate::gateway::Gateway;
use crate::limiter::{Charge, Settled};
use decode::BodyMeter;

/// What the response settles of a request's metered charges (DESIGN §12).
#[derive(Default)]
pub struct Metering {
    /// Charges of metered policies the response settles.
    pub charges: Vec<Charge>,
    /// `cost = { usage = … }`: the upstream's body read as it passes (through its
    /// Content-Encoding), and whether it ended whole (a cut one is read as far as it went).
    meter: Option<BodyMeter>,
    body_ended: bool,
    /// The upstream's status once its response header came: a client that goes away
    /// from a 2xx keeps its charges (DESIGN §17).
    pub upstream_status: Option<u16>,
}

impl Metering {
    /// The upstream's final response header came: charges by status and by header are
    /// settled; charges by usage wait for its body, read as it passes.
    pub async fn response_started(
        &mut self,
        gateway: Option<&Gateway>,
        route: Option<usize>,
        resp: &ResponseHeader,
    ) {
        self.upstream_status = Some(resp.status.as_u16());
        self.meter = gateway.and_then(|g| self.meter_for(&g.config.policies, resp));
        let status = Some(resp.status.as_u16());
        self.settle(gateway, route, status, Some(&resp.headers), false)
            .await;
    }

    /// A piece of the upstream's body (`end_of_stream`: its last), read for its usage.
    pub fn body(&mut self, body: &Option<Bytes>, end_of_stream: bool) {
        if let Some(meter) = &mut self.meter {
            if let Some(bytes) = body {
                meter.feed(bytes);
            }
            if end_of_stream && !self.body_ended {
                meter.finish();
                self.body_ended = true;
            }
        }
    }

    /// Whether a charge waits for the response's cost (its body's usage, or a header).
    pub fn by_response(&self, policies: &[crate::config::Policy]) -> bool {
        self.charges.iter().any(|c| {
            matches!(
                policies[c.policy].metering,
                Some(Metered::Usage(_) | Metered::Header(_))
            )
        })
    }

    /// Settles the request's metered charges (DESIGN §12) by the response's status (None:
    /// the client went away before one was sent), from an upstream its header, and once the
    /// response has `ended`, its body's usage; until then charges by usage stay pending. A
    /// usage read from the bytes that passed is charged even when the body was cut (the
    /// client closed right after `[DONE]`, DESIGN §21); without one, the reservation.
    pub async fn settle(
        &mut self,
        gateway: Option<&Gateway>,
        route: Option<usize>,
        status: Option<u16>,
        upstream: Option<&http::HeaderMap>,
        ended: bool,
    ) {
        let (Some(gateway), Some(route)) = (gateway, route) else {
            return;
        };
        let policies = &gateway.config.policies;
        let success = status.is_some_and(|s| (200..300).contains(&s));
        if ended && !self.body_ended {
            if let Some(meter) = &mut self.meter {
                meter.finish();
            }
            self.body_ended = true;
        }
        let usage = self.meter.as_ref().filter(|_| self.body_ended);
        let mut pending = Vec::new();
        let mut settled = Vec::with_capacity(self.charges.len());
        for charge in std::mem::take(&mut self.charges) {
            let how = match (&policies[charge.policy].metering, status) {
                (Some(Metered::Usage(_)), _) if !ended => {
                    pending.push(charge);
                    continue;
                }
                (Some(Metered::Usage(format)), _) => usage
                    .and_then(|meter| meter.cost(*format))
                    .map_or(Settled::Missing { kept: success }, Settled::Cost),
                (Some(m @ Metered::Status(_)), Some(s)) if !m.counts(s) => Settled::Refunded,
                (Some(Metered::Status(_)), _) => Settled::Kept,
                (Some(Metered::Header(name)), _) => upstream
                    .and_then(|h| h.get(name))
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map_or(Settled::Missing { kept: success }, Settled::Cost),
                _ => Settled::Missing { kept: success },
            };
            settled.push((charge, how));
        }
        self.charges = pending;
        if !settled.is_empty() {
            gateway.limiter.settle(route, policies, settled).await;
        }
    }

    /// A meter for the upstream's body when a charge waits for its usage, and the body can be
    /// read: as it is, or through a coding sluice decodes (DESIGN §17); another coding's usage
    /// is unreadable, so it is charged as missing.
    fn meter_for(
        &self,
        policies: &[crate::config::Policy],
        resp: &ResponseHeader,
    ) -> Option<BodyMeter> {
        let waits = self
            .charges
            .iter()
            .any(|c| matches!(policies[c.policy].metering, Some(Metered::Usage(_))));
        if !waits {
            return None;
        }
        let headers = &resp.headers;
        BodyMeter::new(
            headers
                .get(http::header::CONTENT_TYPE)
                .map(|t| t.as_bytes()),
            headers
                .get_all(http::header::CONTENT_ENCODING)
                .iter()
                .map(|e| e.as_bytes()),
        )
    }
}

#[derive(Debug)]
pub struct UsageMeter {
    body: Body,
    found: Found,
}

#[derive(Debug)]
enum Body {
    Json(Scanner),
    Sse(Sse),
}

impl UsageMeter {
    /// A meter for a body of `content_type` (`text/event-stream` is read as SSE, anything
    /// else as one JSON text).
    pub fn new(content_type: Option<&[u8]>) -> UsageMeter {
        let sse = content_type
            .is_some_and(|t| t.len() >= 17 && t[..17].eq_ignore_ascii_case(b"text/event-stream"));
        UsageMeter {
            body: if sse {
                Body::Sse(Sse::default())
            } else {
                Body::Json(Scanner::default())
            },
            found: [None; SLOTS],
        }
    }

    pub fn feed(&mut self, bytes: &bytes::Bytes) {
        match &mut self.body {
            Body::Json(json) => json.feed(bytes, &mut self.found),
            Body::Sse(sse) => sse.feed(bytes, &mut self.found),
        }
    }

    /// The body ended whole: what its end says is read.
    pub fn finish(&mut self) {
        match &mut self.body {
            // A number at the very end of the text ends with it.
            Body::Json(json) => json.feed(b" ", &mut self.found),
            Body::Sse(sse) => sse.finish(&mut self.found),
        }
    }

    /// Whether more of the body can change what it reports: a whole JSON text that has
    /// ended (or broken off) reads nothing more.
    pub fn wants_more(&self) -> bool {
        match &self.body {
            Body::Json(json) => !json.stopped(),
            Body::Sse(_) => true,
        }
    }

    /// Bytes of the body this meter holds (its head and, by reference, its tail).
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        match &self.body {
            Body::Json(_) => 0,
            Body::Sse(sse) => sse.kept(),
        }
    }

    /// The cost in `format`, if the body reported it.
    pub fn cost(&self, format: UsageFormat) -> Option<u64> {
        let get = |slot: Slot| self.found[slot as usize];
        match format {
            UsageFormat::OpenAi => get(Slot::OpenAiTotal),
            UsageFormat::Gemini => get(Slot::GeminiTotal),
            UsageFormat::Anthropic(weights) => {
                let [input, output, write, read] = [
                    Slot::AnthropicInput,
                    Slot::AnthropicOutput,
                    Slot::AnthropicCacheWrite,
                    Slot::AnthropicCacheRead,
                ]
                .map(get);
                [input, output, write, read]
                    .iter()
                    .any(Option::is_some)
                    .then(|| {
                        let cached = weights.weigh(read.unwrap_or(0), write.unwrap_or(0));
                        [input, output]
                            .iter()
                            .fold(cached, |sum, n| sum.saturating_add(n.unwrap_or(0)))
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::request::{ask_for_usage, request_bound, Written};
    use super::sse::MAX_EVENT;
    use super::*;
    use crate::config::CacheWeights;

    fn read(content_type: &str, chunks: &[&str]) -> UsageMeter {
        let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
        for chunk in chunks {
            meter.feed(&bytes::Bytes::copy_from_slice(chunk.as_bytes()));
        }
        meter.finish();
        meter
    }

    /// The same text fed whole and one byte at a time.
    fn both_ways(content_type: &str, text: &str, format: UsageFormat) -> Option<u64> {
        let whole = read(content_type, &[text]).cost(format);
        let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
        for b in text.as_bytes() {
            meter.feed(&bytes::Bytes::copy_from_slice(std::slice::from_ref(b)));
        }
        meter.finish();
        assert_eq!(whole, meter.cost(format), "byte by byte differs: {text}");
        whole
    }

    #[test]
    fn openai_chat_completion_whole() {
        let body = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"the \"usage\": {\"total_tokens\": 999} is text"}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::OpenAi),
            Some(21)
        );
    }

    #[test]
    fn openai_stream_takes_the_final_usage_and_ignores_done() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\r\n\r\n\
                      data: [DONE]\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::OpenAi),
            Some(12)
        );
    }

    #[test]
    fn openai_responses_api_completed_event() {
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                      event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":3,\"output_tokens\":4,\"total_tokens\":7}}}\n\n";
        assert_eq!(
            both_ways(
                "text/event-stream; charset=utf-8",
                stream,
                UsageFormat::OpenAi
            ),
            Some(7)
        );
    }

    #[test]
    fn anthropic_stream_reads_output_as_cumulative() {
        let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                      event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hello\"}}\n\n\
                      event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":10}}\n\n\
                      event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n\
                      event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(
            both_ways(
                "text/event-stream",
                stream,
                UsageFormat::Anthropic(CacheWeights::ONE)
            ),
            Some(40)
        );
    }

    #[test]
    fn anthropic_cache_tokens_are_input_tokens() {
        let body = r#"{"id":"m","type":"message","usage":{"input_tokens":1,"cache_creation_input_tokens":20000,"cache_read_input_tokens":10000,"output_tokens":100}}"#;
        assert_eq!(
            both_ways(
                "application/json",
                body,
                UsageFormat::Anthropic(CacheWeights::ONE)
            ),
            Some(30_101)
        );
        let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":30000,\"output_tokens\":1}}}\n\n\
                      event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":100}}\n\n";
        assert_eq!(
            both_ways(
                "text/event-stream",
                stream,
                UsageFormat::Anthropic(CacheWeights::ONE)
            ),
            Some(30_101)
        );
    }

    #[test]
    fn anthropic_cache_tokens_may_be_weighed_rounded_up() {
        let body = r#"{"usage":{"input_tokens":1,"cache_creation_input_tokens":3,"cache_read_input_tokens":11,"output_tokens":100}}"#;
        let weights = CacheWeights {
            read: 100_000,
            write: 1_250_000,
        };
        // 11 x 0.1 + 3 x 1.25 = 4.85, rounded up to 5.
        assert_eq!(
            both_ways("application/json", body, UsageFormat::Anthropic(weights)),
            Some(106)
        );
        let free = CacheWeights { read: 0, write: 0 };
        assert_eq!(
            both_ways("application/json", body, UsageFormat::Anthropic(free)),
            Some(101)
        );
    }

    #[test]
    fn anthropic_whole_message() {
        let body = r#"{"id":"m","type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":10,"output_tokens":32}}"#;
        assert_eq!(
            both_ways(
                "application/json",
                body,
                UsageFormat::Anthropic(CacheWeights::ONE)
            ),
            Some(42)
        );
    }

    #[test]
    fn gemini_whole_streamed_and_as_an_array() {
        let body = r#"{"candidates":[{"content":{"parts":[{"text":"x"}]}}],"usageMetadata":{"promptTokenCount":4,"candidatesTokenCount":6,"totalTokenCount":10}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::Gemini),
            Some(10)
        );
        let stream = "data: {\"usageMetadata\":{\"totalTokenCount\":5}}\r\n\r\ndata: {\"usageMetadata\":{\"totalTokenCount\":11}}\r\n\r\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::Gemini),
            Some(11)
        );
        let array =
            r#"[{"usageMetadata":{"totalTokenCount":3}},{"usageMetadata":{"totalTokenCount":8}}]"#;
        assert_eq!(
            both_ways("application/json", array, UsageFormat::Gemini),
            Some(8)
        );
    }

    #[test]
    fn data_split_over_lines_is_one_json_text() {
        let stream = "data: {\"usage\":\ndata: {\"total_tokens\":\ndata: 33}}\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::OpenAi),
            Some(33)
        );
    }

    #[test]
    fn nothing_usable_is_none() {
        for (content_type, body) in [
            ("application/json", r#"{"usage":{"total_tokens":"12"}}"#),
            ("application/json", r#"{"usage":{"total_tokens":1.5}}"#),
            ("application/json", r#"{"usage":{"total_tokens":-3}}"#),
            (
                "application/json",
                r#"{"choices":[{"usage":{"total_tokens":4}}]}"#,
            ),
            ("application/json", r#"{"usage":{"total_tokens":"#),
            (
                "application/json",
                "not json at all {\"usage\":{\"total_tokens\":5}}",
            ),
            (
                "text/event-stream",
                "data: {\"choices\":[]}\n\ndata: [DONE]\n\n",
            ),
            (
                "text/event-stream",
                ": comment {\"usage\":{\"total_tokens\":5}}\n\n",
            ),
        ] {
            assert_eq!(
                both_ways(content_type, body, UsageFormat::OpenAi),
                None,
                "{body}"
            );
        }
    }

    #[test]
    fn a_number_at_the_end_of_an_event_counts_and_later_text_is_ignored() {
        // The JSON text ends with the number: the blank line ends it.
        let stream = "data: {\"usageMetadata\":{\"totalTokenCount\":7}}\n\n";
        assert_eq!(
            both_ways("text/event-stream", stream, UsageFormat::Gemini),
            Some(7)
        );
        let body = r#"{"usage":{"total_tokens":4}} {"usage":{"total_tokens":99}}"#;
        assert_eq!(
            both_ways("application/json", body, UsageFormat::OpenAi),
            Some(4)
        );
    }

    #[test]
    fn deep_and_long_keys_are_skipped_without_losing_the_path() {
        let deep = "[".repeat(100) + &"]".repeat(100);
        let long_key = "k".repeat(500);
        let body = format!(
            r#"{{"a":{deep},"{long_key}":{{"total_tokens":5}},"usage":{{"x":"y\"z","total_tokens":17}}}}"#
        );
        assert_eq!(
            both_ways("application/json", &body, UsageFormat::OpenAi),
            Some(17)
        );
    }

    /// The formats' streams and whole bodies, with what they cost.
    fn samples() -> Vec<(&'static str, String, UsageFormat, u64)> {
        vec![
            (
                "text/event-stream",
                "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                 data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n\
                 data: [DONE]\n\n"
                    .into(),
                UsageFormat::OpenAi,
                12,
            ),
            (
                "text/event-stream",
                "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                 event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"total_tokens\":7}}}\n\n"
                    .into(),
                UsageFormat::OpenAi,
                7,
            ),
            (
                "text/event-stream",
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                 event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":10}}\n\n\
                 event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n\
                 event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
                    .into(),
                UsageFormat::Anthropic(CacheWeights::ONE),
                40,
            ),
            (
                "text/event-stream",
                "data: {\"usageMetadata\":{\"totalTokenCount\":5}}\n\ndata: {\"usageMetadata\":{\"totalTokenCount\":11}}\n\n"
                    .into(),
                UsageFormat::Gemini,
                11,
            ),
            (
                "application/json",
                r#"{"choices":[{"message":{"content":"the \"usage\" is"}}],"usage":{"total_tokens":21}}"#.into(),
                UsageFormat::OpenAi,
                21,
            ),
            (
                "application/json",
                r#"{"content":[{"text":"hi"}],"usage":{"input_tokens":10,"output_tokens":32}}"#.into(),
                UsageFormat::Anthropic(CacheWeights::ONE),
                42,
            ),
            (
                "application/json",
                r#"[{"usageMetadata":{"totalTokenCount":3}},{"usageMetadata":{"totalTokenCount":8}}]"#.into(),
                UsageFormat::Gemini,
                8,
            ),
        ]
    }

    /// `sample` with `filler` events (or array elements) between its first part and the
    /// rest, and its line ends written as `eol`.
    fn with_filler(content_type: &str, sample: &str, filler: usize, eol: &str) -> String {
        if content_type == "application/json" {
            let pad = r#"{"x":"y"},"#.repeat(filler);
            return match sample.strip_prefix('[') {
                Some(rest) => format!("[{pad}{rest}"),
                None => format!(r#"{{"pad":[{pad}1],{}"#, &sample[1..]),
            };
        }
        let first = sample.find("\n\n").map_or(0, |at| at + 2);
        let event = "data: {\"choices\":[{\"delta\":{\"content\":\"filler text\"}}]}\n\n";
        let text = format!(
            "{}{}{}",
            &sample[..first],
            event.repeat(filler),
            &sample[first..]
        );
        text.replace('\n', eol)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any split of a stream or a whole body into chunks reads the same usage as the
        /// whole (and as the format says), past the 64 KiB kept of a stream too.
        #[test]
        fn any_split_reads_the_same_usage_as_the_whole(
            which in 0usize..7,
            filler in proptest::prop_oneof![0usize..8, 1200usize..1500],
            eol in proptest::sample::select(vec!["\n", "\r\n", "\r"]),
            cuts in proptest::collection::vec(proptest::prelude::any::<usize>(), 0..16),
        ) {
            let (content_type, sample, format, cost) = samples().swap_remove(which);
            let text = with_filler(content_type, &sample, filler, eol);
            let whole = read(content_type, &[text.as_str()]).cost(format);
            proptest::prop_assert_eq!(whole, Some(cost));
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
            cuts.sort_unstable();
            let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
            let mut at = 0;
            for cut in cuts.into_iter().chain([text.len()]) {
                meter.feed(&bytes::Bytes::copy_from_slice(&text.as_bytes()[at..cut]));
                at = cut;
            }
            meter.finish();
            proptest::prop_assert_eq!(meter.cost(format), whole);
        }

        /// Any bytes, in any chunks: a usage or none, never a panic; what a stream keeps
        /// stays bounded.
        #[test]
        fn any_bytes_are_read_without_panic_within_bounds(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            chunk in 1usize..512,
        ) {
            for content_type in ["text/event-stream", "application/json"] {
                let mut meter = UsageMeter::new(Some(content_type.as_bytes()));
                for piece in bytes.chunks(chunk) {
                    meter.feed(&bytes::Bytes::copy_from_slice(piece));
                    proptest::prop_assert!(meter.kept() <= 2 * MAX_EVENT + chunk);
                }
                meter.finish();
                let _ = meter.cost(UsageFormat::Anthropic(CacheWeights::ONE));
            }
            let _ = ask_for_usage(&bytes);
            let written = Written {
                tokens: 1,
                format: None,
            };
            let _ = request_bound(&bytes, written);
        }
    }
}
