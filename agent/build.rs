//! Generates the `raw.pb` message types from `src/session/raw.proto`:
//! protox compiles the file (a protobuf compiler in Rust, so no system
//! `protoc` is needed) and prost-build writes the Rust types into OUT_DIR.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "src/session/raw.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["src/session"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
