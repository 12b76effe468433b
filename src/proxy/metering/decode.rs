//! Reading a response's usage through its `Content-Encoding` (DESIGN §17 "Encoding does not
//! hide usage"): sluice asks metered upstreams for `identity`, and when one encodes anyway a
//! copy of the body is decoded as it passes and fed to the usage meter; the client gets the
//! bytes the upstream sent.
//!
//! Decoding is incremental and bounded: each decoder writes its output through a buffer of
//! its own (32 KiB for gzip and deflate, `BROTLI_BUFFER`, zstd's 128 KiB), handed to the
//! meter piece by piece, so what a body decodes to never accumulates (the meter keeps what
//! it keeps of a plain body: see `UsageMeter`), whatever the ratio of a decompression bomb. Only
//! the decoders' windows are held besides: 32 KiB for gzip and deflate, the stream's own for
//! br (at most 16 MiB: large windows are refused) and zstd (at most `ZSTD_WINDOW_LOG_MAX`),
//! the bounds browsers decode them with. A whole JSON body stops being decoded once its
//! text has ended.

use std::io::Write;

use bytes::Bytes;

use super::UsageMeter;
use crate::config::UsageFormat;

/// Decoded bytes handed to the meter at a time by the brotli decoder.
const BROTLI_BUFFER: usize = 16 * 1024;
/// The largest zstd window decoded: 8 MiB, as browsers take `Content-Encoding: zstd`
/// (RFC 9659 §3); a frame that needs more is not read.
const ZSTD_WINDOW_LOG_MAX: u32 = 23;

/// A response body's usage meter: the body read as it is, or through its coding.
pub enum BodyMeter {
    Plain(Box<UsageMeter>),
    Decoded(Box<Decoded>),
}

impl BodyMeter {
    /// A meter for a body of `content_type` sent with the `Content-Encoding` values
    /// `codings`; None when they name a coding sluice does not read (or more than one).
    pub fn new<'a>(
        content_type: Option<&[u8]>,
        codings: impl Iterator<Item = &'a [u8]>,
    ) -> Option<BodyMeter> {
        let meter = UsageMeter::new(content_type);
        match Coding::of(codings)? {
            None => Some(BodyMeter::Plain(Box::new(meter))),
            Some(coding) => Some(BodyMeter::Decoded(Box::new(Decoded::new(coding, meter)?))),
        }
    }

    pub fn feed(&mut self, bytes: &Bytes) {
        match self {
            BodyMeter::Plain(meter) => meter.feed(bytes),
            BodyMeter::Decoded(decoded) => decoded.feed(bytes),
        }
    }

    /// The body ended whole.
    pub fn finish(&mut self) {
        match self {
            BodyMeter::Plain(meter) => meter.finish(),
            BodyMeter::Decoded(decoded) => decoded.finish(),
        }
    }

    /// The cost in `format`, if the body reported it (and, encoded, decoded cleanly).
    pub fn cost(&self, format: UsageFormat) -> Option<u64> {
        match self {
            BodyMeter::Plain(meter) => meter.cost(format),
            BodyMeter::Decoded(decoded) => decoded.meter()?.cost(format),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
    Brotli,
    Zstd,
}

impl Coding {
    /// The one coding named by `Content-Encoding` values (`identity` aside): `Some(None)`
    /// for none, None for one sluice does not read, or a stack of them.
    fn of<'a>(values: impl Iterator<Item = &'a [u8]>) -> Option<Option<Coding>> {
        let mut found = None;
        for value in values {
            for name in value.split(|&b| b == b',') {
                let name = name.trim_ascii();
                if name.is_empty() || name.eq_ignore_ascii_case(b"identity") {
                    continue;
                }
                if found.is_some() {
                    return None;
                }
                found = Some(Coding::named(name)?);
            }
        }
        Some(found)
    }

    fn named(name: &[u8]) -> Option<Coding> {
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        if is(b"gzip") || is(b"x-gzip") {
            Some(Coding::Gzip)
        } else if is(b"deflate") {
            Some(Coding::Deflate)
        } else if is(b"br") {
            Some(Coding::Brotli)
        } else if is(b"zstd") {
            Some(Coding::Zstd)
        } else {
            None
        }
    }
}

/// Where a decoder writes: the meter, fed each piece of output as it comes.
struct Sink {
    meter: UsageMeter,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.meter.wants_more() {
            self.meter.feed(&Bytes::copy_from_slice(buf));
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An encoded body, decoded as it passes into its meter.
pub struct Decoded {
    coder: Coder,
    /// Input was left undecoded once the meter wanted no more.
    skipped: bool,
}

// Boxed whole in `BodyMeter::Decoded`: the variants' sizes do not multiply.
#[allow(clippy::large_enum_variant)]
enum Coder {
    Gzip(flate2::write::MultiGzDecoder<Sink>),
    Zlib(flate2::write::ZlibDecoder<Sink>),
    RawDeflate(flate2::write::DeflateDecoder<Sink>),
    /// `deflate` until its first two bytes say whether it is zlib-wrapped (RFC 9110
    /// §8.4.1.2) or raw, as some servers send it and browsers take it.
    Deflate(Sink, Vec<u8>),
    Brotli(brotli::DecompressorWriter<Sink>),
    Zstd(zstd::stream::write::Decoder<'static, Sink>),
    /// Malformed, truncated, or over a bound: no cost can be read.
    Broken,
}

impl Decoded {
    fn new(coding: Coding, meter: UsageMeter) -> Option<Decoded> {
        let sink = Sink { meter };
        let coder = match coding {
            Coding::Gzip => Coder::Gzip(flate2::write::MultiGzDecoder::new(sink)),
            Coding::Deflate => Coder::Deflate(sink, Vec::with_capacity(2)),
            Coding::Brotli => Coder::Brotli(brotli::DecompressorWriter::new(sink, BROTLI_BUFFER)),
            Coding::Zstd => {
                use zstd::stream::raw;
                let mut decoder = raw::Decoder::new().ok()?;
                decoder
                    .set_parameter(raw::DParameter::WindowLogMax(ZSTD_WINDOW_LOG_MAX))
                    .ok()?;
                Coder::Zstd(zstd::stream::write::Decoder::with_decoder(sink, decoder))
            }
        };
        Some(Decoded {
            coder,
            skipped: false,
        })
    }

    fn feed(&mut self, mut input: &[u8]) {
        if let Coder::Deflate(_, start) = &mut self.coder {
            let take = input.len().min(2 - start.len());
            start.extend_from_slice(&input[..take]);
            input = &input[take..];
            if start.len() < 2 {
                return;
            }
            let Coder::Deflate(sink, start) = std::mem::replace(&mut self.coder, Coder::Broken)
            else {
                return;
            };
            self.coder = if is_zlib(start[0], start[1]) {
                Coder::Zlib(flate2::write::ZlibDecoder::new(sink))
            } else {
                Coder::RawDeflate(flate2::write::DeflateDecoder::new(sink))
            };
            self.write(&start);
        }
        self.write(input);
    }

    fn write(&mut self, input: &[u8]) {
        if input.is_empty() || self.skipped {
            return;
        }
        if !self.meter().is_some_and(UsageMeter::wants_more) {
            self.skipped = true;
            return;
        }
        let written = match &mut self.coder {
            Coder::Gzip(d) => d.write_all(input),
            Coder::Zlib(d) => d.write_all(input),
            Coder::RawDeflate(d) => d.write_all(input),
            Coder::Brotli(d) => d.write_all(input),
            Coder::Zstd(d) => d.write_all(input),
            Coder::Deflate(..) | Coder::Broken => Ok(()),
        };
        if written.is_err() {
            self.coder = Coder::Broken;
        }
    }

    fn finish(&mut self) {
        if !self.skipped {
            let finished = match &mut self.coder {
                Coder::Gzip(d) => d.try_finish(),
                Coder::Zlib(d) => d.try_finish(),
                Coder::RawDeflate(d) => d.try_finish(),
                Coder::Brotli(d) => d.close(),
                Coder::Zstd(d) => d.do_finish(),
                // Fewer than two bytes: no deflate stream is that short.
                Coder::Deflate(..) | Coder::Broken => Err(std::io::ErrorKind::InvalidData.into()),
            };
            if finished.is_err() {
                self.coder = Coder::Broken;
                return;
            }
        }
        if let Some(sink) = self.sink_mut() {
            sink.meter.finish();
        }
    }

    fn meter(&self) -> Option<&UsageMeter> {
        let sink = match &self.coder {
            Coder::Gzip(d) => d.get_ref(),
            Coder::Zlib(d) => d.get_ref(),
            Coder::RawDeflate(d) => d.get_ref(),
            Coder::Brotli(d) => d.get_ref(),
            Coder::Zstd(d) => d.get_ref(),
            Coder::Deflate(sink, _) => sink,
            Coder::Broken => return None,
        };
        Some(&sink.meter)
    }

    fn sink_mut(&mut self) -> Option<&mut Sink> {
        Some(match &mut self.coder {
            Coder::Gzip(d) => d.get_mut(),
            Coder::Zlib(d) => d.get_mut(),
            Coder::RawDeflate(d) => d.get_mut(),
            Coder::Brotli(d) => d.get_mut(),
            Coder::Zstd(d) => d.get_mut(),
            Coder::Deflate(sink, _) => sink,
            Coder::Broken => return None,
        })
    }
}

/// Whether two bytes open a zlib stream (RFC 1950: deflate, a window of at most 32 KiB, and
/// a header check that is a multiple of 31).
fn is_zlib(cmf: u8, flg: u8) -> bool {
    cmf & 0x0f == 8 && cmf >> 4 <= 7 && (u16::from(cmf) << 8 | u16::from(flg)) % 31 == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheWeights;
    use proptest::prelude::*;

    fn encode(coding: &str, text: &[u8]) -> Vec<u8> {
        use flate2::Compression;
        match coding {
            "gzip" => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), Compression::default());
                e.write_all(text).expect("test data");
                e.finish().expect("test data")
            }
            "deflate" => {
                let mut e = flate2::write::ZlibEncoder::new(Vec::new(), Compression::default());
                e.write_all(text).expect("test data");
                e.finish().expect("test data")
            }
            "raw-deflate" => {
                let mut e = flate2::write::DeflateEncoder::new(Vec::new(), Compression::fast());
                e.write_all(text).expect("test data");
                e.finish().expect("test data")
            }
            "br" => {
                let mut out = Vec::new();
                {
                    let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                    w.write_all(text).expect("test data");
                }
                out
            }
            "zstd" => zstd::stream::encode_all(text, 3).expect("test data"),
            other => panic!("{other}"),
        }
    }

    fn header_name(coding: &str) -> &str {
        if coding == "raw-deflate" {
            "deflate"
        } else {
            coding
        }
    }

    const CODINGS: [&str; 5] = ["gzip", "deflate", "raw-deflate", "br", "zstd"];

    /// The cost read from `encoded`, fed in pieces cut at `cuts`.
    fn read(
        content_type: &str,
        coding: &str,
        encoded: &[u8],
        cuts: &[usize],
        format: UsageFormat,
    ) -> Option<u64> {
        let name = header_name(coding);
        let mut meter = BodyMeter::new(
            Some(content_type.as_bytes()),
            std::iter::once(name.as_bytes()),
        )
        .expect("test data");
        let mut at = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (encoded.len() + 1)).collect();
        cuts.sort_unstable();
        for cut in cuts.into_iter().chain([encoded.len()]) {
            meter.feed(&Bytes::copy_from_slice(&encoded[at..cut]));
            at = cut;
        }
        meter.finish();
        meter.cost(format)
    }

    const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                          data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n\
                          data: [DONE]\n\n";
    const WHOLE: &str =
        r#"{"id":"c","choices":[{"message":{"content":"hi"}}],"usage":{"total_tokens":21}}"#;

    #[test]
    fn each_coding_is_read_whole_and_streamed() {
        for coding in CODINGS {
            let sse = encode(coding, STREAM.as_bytes());
            assert_eq!(
                read("text/event-stream", coding, &sse, &[], UsageFormat::OpenAi),
                Some(12),
                "{coding}"
            );
            let json = encode(coding, WHOLE.as_bytes());
            assert_eq!(
                read(
                    "application/json",
                    coding,
                    &json,
                    &[3, 7],
                    UsageFormat::OpenAi
                ),
                Some(21),
                "{coding}"
            );
        }
    }

    #[test]
    fn codings_are_named_as_http_names_them() {
        let of = |values: &[&str]| Coding::of(values.iter().map(|v| v.as_bytes()));
        assert_eq!(of(&[]), Some(None));
        assert_eq!(of(&["identity"]), Some(None));
        assert_eq!(of(&["GZIP"]), Some(Some(Coding::Gzip)));
        assert_eq!(of(&["x-gzip"]), Some(Some(Coding::Gzip)));
        assert_eq!(of(&[" br , identity"]), Some(Some(Coding::Brotli)));
        assert_eq!(of(&["zstd"]), Some(Some(Coding::Zstd)));
        assert_eq!(of(&["deflate"]), Some(Some(Coding::Deflate)));
        // Not read: an unknown coding, or a stack (in one value or in two).
        assert_eq!(of(&["compress"]), None);
        assert_eq!(of(&["gzip, br"]), None);
        assert_eq!(of(&["gzip", "br"]), None);
    }

    #[test]
    fn a_truncated_or_corrupt_body_has_no_cost() {
        for coding in CODINGS {
            let json = encode(coding, WHOLE.as_bytes());
            let cut = &json[..json.len() - 4];
            assert_eq!(
                read("text/event-stream", coding, cut, &[], UsageFormat::OpenAi),
                None,
                "{coding} truncated"
            );
        }
        let mut gzip = encode("gzip", STREAM.as_bytes());
        let n = gzip.len();
        gzip[n - 6] ^= 0xff; // the CRC
        assert_eq!(
            read("text/event-stream", "gzip", &gzip, &[], UsageFormat::OpenAi),
            None
        );
        assert_eq!(
            read(
                "application/json",
                "deflate",
                b"x",
                &[],
                UsageFormat::OpenAi
            ),
            None
        );
    }

    #[test]
    fn a_zstd_window_over_8_mib_is_not_read() {
        let encode_with = |window_log: u32| {
            let mut e = zstd::stream::write::Encoder::new(Vec::new(), 3).expect("test data");
            e.set_parameter(zstd::stream::raw::CParameter::WindowLog(window_log))
                .expect("test data");
            e.write_all(STREAM.as_bytes()).expect("test data");
            e.finish().expect("test data")
        };
        let ok = encode_with(23);
        assert_eq!(
            read("text/event-stream", "zstd", &ok, &[], UsageFormat::OpenAi),
            Some(12)
        );
        let big = encode_with(27);
        assert_eq!(
            read("text/event-stream", "zstd", &big, &[], UsageFormat::OpenAi),
            None
        );
    }

    #[test]
    fn a_decompression_bomb_grows_no_memory_and_a_whole_body_stops_when_read() {
        // 64 MiB of SSE comments after the first event, then the usage: a few hundred KiB
        // gzipped. What the meter holds stays within its bound as it passes.
        let mut text = String::from("data: {\"choices\":[]}\n\n");
        let comments = ": keep-alive\n".repeat(64 * 1024 * 1024 / 13);
        text.push_str(&comments);
        text.push_str("\ndata: {\"usage\":{\"total_tokens\":9}}\n\n");
        let encoded = encode("gzip", text.as_bytes());
        let mut meter = BodyMeter::new(
            Some(b"text/event-stream".as_slice()),
            std::iter::once(b"gzip".as_slice()),
        )
        .expect("test data");
        let mut most = 0;
        for piece in encoded.chunks(16 * 1024) {
            meter.feed(&Bytes::copy_from_slice(piece));
            if let BodyMeter::Decoded(d) = &meter {
                most = most.max(d.meter().map_or(0, UsageMeter::kept));
            }
        }
        meter.finish();
        assert_eq!(meter.cost(UsageFormat::OpenAi), Some(9));
        assert!(most <= 64 * 1024 + 32 * 1024, "held {most} bytes");

        // A whole JSON body's text ends early: the rest is not decoded.
        let mut body = WHOLE.to_owned();
        body.push_str(&" ".repeat(64 * 1024 * 1024));
        let encoded = encode("gzip", body.as_bytes());
        let mut meter =
            BodyMeter::new(None, std::iter::once(b"gzip".as_slice())).expect("test data");
        for piece in encoded.chunks(16 * 1024) {
            meter.feed(&Bytes::copy_from_slice(piece));
        }
        meter.finish();
        assert_eq!(meter.cost(UsageFormat::OpenAi), Some(21));
        let BodyMeter::Decoded(d) = &meter else {
            panic!("decoded")
        };
        assert!(d.skipped, "the padding was left undecoded");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any split of an encoded body reads as the whole does.
        #[test]
        fn any_split_of_an_encoded_body_reads_the_same(
            coding in proptest::sample::select(CODINGS.to_vec()),
            sse in any::<bool>(),
            filler in 0usize..400,
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let (content_type, text) = if sse {
                let mut text = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".repeat(filler);
                text.push_str(STREAM);
                ("text/event-stream", text)
            } else {
                let pad = "\"x\",".repeat(filler);
                (
                    "application/json",
                    format!(r#"{{"choices":[{pad}"y"],"usage":{{"total_tokens":21}}}}"#),
                )
            };
            let encoded = encode(coding, text.as_bytes());
            let want = if sse { Some(12) } else { Some(21) };
            prop_assert_eq!(
                read(content_type, coding, &encoded, &cuts, UsageFormat::OpenAi),
                want
            );
        }

        /// Any bytes under any coding: a cost or none, never a panic.
        #[test]
        fn any_bytes_under_any_coding_are_read_without_panic(
            coding in proptest::sample::select(CODINGS.to_vec()),
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let _ = read("text/event-stream", coding, &bytes, &cuts, UsageFormat::OpenAi);
            let _ = read("application/json", coding, &bytes, &cuts, UsageFormat::Anthropic(CacheWeights::ONE));
        }
    }
}
