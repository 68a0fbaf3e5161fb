//! `dmabuf-rt`: command-line front end.

use std::process::ExitCode;

const USAGE: &str = "usage: dmabuf-rt <command>

commands:
  devices    list DMA-BUF heaps, udmabuf and DRM nodes, and whether this process may open them
  help       this text";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("devices") => {
            print!("{}", dmabuf_rt::discovery::discover());
            ExitCode::SUCCESS
        }
        Some("help" | "-h" | "--help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("dmabuf-rt: unknown command `{other}`\n\n{USAGE}");
            ExitCode::from(2)
        }
        None => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
