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
