//! Prints the path of the nats-server the tests use ([`volley_testkit::find_nats_server`]),
//! installing the pinned one first when there is none: scripts and CI steps outside
//! `cargo test` use the same binary as the tests.

fn main() {
    println!("{}", volley_testkit::find_nats_server().display());
}
