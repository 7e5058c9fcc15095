//! Realistic inputs to mutate: what real servers write, as bytes.

use crate::pipeline::synthetic::{Records, Traffic, TrafficConfig};

/// Raw ring buffer records of a small vLLM/uvicorn-shaped run: accepts,
/// request reads, chunked SSE in three writes per event, CUDA syncs,
/// off-CPU intervals, USDT marks, closes.
pub fn raw_records() -> Vec<Vec<u8>> {
    let mut traffic = Traffic::new(TrafficConfig {
        connections: 3,
        min_tokens: 3,
        max_tokens: 6,
        step_ns: 10_000_000,
        stall_every: 4,
        requests_per_connection: 2,
        seed: 7,
    });
    let mut out = Records::default();
    let mut records = Vec::new();
    while records.len() < 400 && traffic.elapsed_ns() < 5_000_000_000 {
        out.clear();
        traffic.step(&mut out);
        records.extend(out.iter().map(<[u8]>::to_vec));
    }
    records
}

/// An OpenAI chat completion request, streaming.
pub fn request() -> Vec<u8> {
    let body = br#"{"model":"meta-llama/Llama-3.1-8B-Instruct","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut r = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n\
         traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// Responses of the servers the design names, each as the bytes one
/// connection carries.
pub fn responses() -> Vec<Vec<u8>> {
    let openai = |id: &str, word: &str| {
        format!(
            "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
        )
    };
    // vLLM / OpenAI: chunked SSE, one event per chunk, usage at the end
    let mut vllm = String::from(
        "HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 10:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    for w in ["Hello", " world", "!"] {
        vllm.push_str(&chunk(&openai("chatcmpl-9f2", w)));
    }
    vllm.push_str(&chunk("data: {\"id\":\"chatcmpl-9f2\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15}}\n\n"));
    vllm.push_str(&chunk("data: [DONE]\n\n"));
    vllm.push_str("0\r\n\r\n");
    // llama.cpp: "id" after choices and created, CRLF framing, no chunked
    let mut llama = String::from(
        "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: text/event-stream\r\nServer: llama.cpp\r\nConnection: close\r\n\r\n",
    );
    for w in ["The", " sky"] {
        llama.push_str(&format!(
            "data: {{\"choices\":[{{\"finish_reason\":null,\"index\":0,\"delta\":{{\"content\":\"{w}\"}}}}],\"created\":1700000000,\"id\":\"chatcmpl-Lq3\",\"model\":\"gpt-3.5-turbo\",\"object\":\"chat.completion.chunk\"}}\r\n\r\n"
        ));
    }
    llama.push_str("data: [DONE]\r\n\r\n");
    // TGI: event stream with comments and id lines, chunked
    let mut tgi = String::from(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    tgi.push_str(&chunk(": keep-alive\n\n"));
    tgi.push_str(&chunk("id: 1\nevent: message\ndata: {\"token\":{\"id\":1,\"text\":\"Hi\",\"logprob\":-0.1,\"special\":false},\"generated_text\":null}\n\n"));
    tgi.push_str(&chunk("data:{\"token\":{\"id\":2,\"text\":\"!\"},\"generated_text\":\"Hi!\",\"details\":null}\n\n"));
    tgi.push_str("0\r\n\r\n");
    // non-streaming JSON with Content-Length
    let body = r#"{"id":"chatcmpl-abc","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}"#;
    let json = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    // chunked plain text, with chunk extensions and trailers
    let text = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n".to_string();
    // 100-continue, then a 204
    let interim = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n".to_string();
    [vllm, llama, tgi, json, text, interim]
        .into_iter()
        .map(String::into_bytes)
        .collect()
}

/// One HTTP/2 frame.
pub fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// HPACK string literals with a new name, no Huffman: with incremental
/// indexing (RFC 7541 §6.2.1, so the decoder's dynamic table fills) or
/// without (§6.2.2, what a decoder must read whatever its table).
pub fn hpack_literals(headers: &[(&str, &str)], indexed: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.push(if indexed { 0x40 } else { 0x00 });
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.push(value.len() as u8);
        out.extend_from_slice(value.as_bytes());
    }
    out
}

fn hpack_indexed_literals(headers: &[(&str, &str)]) -> Vec<u8> {
    hpack_literals(headers, true)
}

/// One uncompressed gRPC length-prefixed message.
pub fn grpc_message(body: &[u8]) -> Vec<u8> {
    let mut m = vec![0];
    m.extend_from_slice(&(body.len() as u32).to_be_bytes());
    m.extend_from_slice(body);
    m
}

/// (client bytes, server bytes) of HTTP/2 connections as servers write
/// them: a gRPC server stream (grpc-core style, several messages per DATA
/// frame, trailers), SSE over HTTP/2 with a Huffman-coded header block
/// (RFC 7541 C.4.1) and a padded DATA frame, and two interleaved streams
/// with a client WINDOW_UPDATE and an RST_STREAM.
pub fn h2_connections() -> Vec<(Vec<u8>, Vec<u8>)> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let settings = h2_frame(4, 0, 0, &[0, 4, 0, 0x40, 0, 0, 0, 5, 0, 0, 0x40, 0]);
    let mut grpc_client = PREFACE.to_vec();
    grpc_client.extend(&settings);
    grpc_client.extend(h2_frame(
        1,
        0x4,
        1,
        &hpack_indexed_literals(&[
            (":path", "/tokentrace.test.Streamer/Generate"),
            ("content-type", "application/grpc"),
            ("x-request-id", "fuzz-1"),
        ]),
    ));
    grpc_client.extend(h2_frame(0, 0x1, 1, &grpc_message(b"\x08\x05")));
    let mut grpc_server = h2_frame(4, 0, 0, &[]);
    grpc_server.extend(h2_frame(4, 0x1, 0, &[]));
    grpc_server.extend(h2_frame(
        1,
        0x4,
        1,
        &[
            &[0x88][..],
            &hpack_indexed_literals(&[("content-type", "application/grpc")]),
        ]
        .concat(),
    ));
    let mut batch = Vec::new();
    for token in [&b"Hello"[..], b",", b" world"] {
        batch.extend(grpc_message(token));
    }
    grpc_server.extend(h2_frame(0, 0, 1, &batch));
    grpc_server.extend(h2_frame(0, 0, 1, &grpc_message(&[b't'; 300])));
    grpc_server.extend(h2_frame(
        1,
        0x5,
        1,
        &hpack_indexed_literals(&[("grpc-status", "0"), ("grpc-message", "")]),
    ));

    let mut sse_client = PREFACE.to_vec();
    sse_client.extend(&settings);
    // :method GET, :scheme http, :path /, :authority www.example.com
    // (Huffman), then a request id.
    let mut block = vec![
        0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90,
        0xf4, 0xff,
    ];
    block.extend(hpack_indexed_literals(&[("x-request-id", "fuzz-2")]));
    sse_client.extend(h2_frame(1, 0x5, 3, &block));
    let mut sse_server = h2_frame(4, 0, 0, &[]);
    sse_server.extend(h2_frame(
        1,
        0x4,
        3,
        &[
            &[0x88][..],
            &hpack_indexed_literals(&[("content-type", "text/event-stream")]),
        ]
        .concat(),
    ));
    for i in 0..3 {
        let event =
            format!("data: {{\"id\":\"chatcmpl-fuzz\",\"choices\":[{{\"delta\":\"{i}\"}}]}}\n\n");
        sse_server.extend(h2_frame(0, 0, 3, event.as_bytes()));
    }
    let mut padded = vec![4];
    padded.extend_from_slice(b"data: [DONE]\n\n");
    padded.extend_from_slice(&[0; 4]);
    sse_server.extend(h2_frame(0, 0x9, 3, &padded));

    let mut two_client = PREFACE.to_vec();
    two_client.extend(&settings);
    for id in [1u32, 3] {
        two_client.extend(h2_frame(
            1,
            0x5,
            id,
            &hpack_indexed_literals(&[(":method", "GET"), (":path", "/v1/stream")]),
        ));
    }
    two_client.extend(h2_frame(8, 0, 0, &[0, 1, 0, 0]));
    two_client.extend(h2_frame(3, 0, 3, &[0, 0, 0, 8]));
    let mut two_server = h2_frame(4, 0, 0, &[]);
    for id in [1u32, 3] {
        two_server.extend(h2_frame(
            1,
            0x4,
            id,
            &[
                &[0x88][..],
                &hpack_indexed_literals(&[("content-type", "text/event-stream")]),
            ]
            .concat(),
        ));
    }
    for i in 0..4u32 {
        let id = if i % 2 == 0 { 1 } else { 3 };
        two_server.extend(h2_frame(0, 0, id, b"data: {\"id\":\"x\"}\n\n"));
    }
    two_server.extend(h2_frame(0, 0x1, 1, b""));
    vec![
        (grpc_client, grpc_server),
        (sse_client, sse_server),
        (two_client, two_server),
    ]
}
