//! Builds the libfabric shim (csrc/fabric_shim.c) for the `rdma` feature. libfabric's headers
//! are needed here (Debian: libfabric-dev); the library itself is opened at run time.

fn main() {
    println!("cargo:rerun-if-changed=csrc/fabric_shim.c");
    println!("cargo:rerun-if-env-changed=PDFLOW_LIBFABRIC_INCLUDE");
    if std::env::var_os("CARGO_FEATURE_RDMA").is_none() {
        return;
    }
    let include = std::env::var("PDFLOW_LIBFABRIC_INCLUDE").unwrap_or_else(|_| "/usr/include".to_string());
    let header = std::path::Path::new(&include).join("rdma/fabric.h");
    if !header.exists() {
        panic!(
            "the rdma feature needs libfabric's headers and {} is missing: install them (Debian/Ubuntu: \
             apt-get install libfabric-dev) or set PDFLOW_LIBFABRIC_INCLUDE to the folder holding rdma/fabric.h",
            header.display()
        );
    }
    cc::Build::new().file("csrc/fabric_shim.c").include(&include).warnings(true).compile("pdflow_fabric_shim");
    println!("cargo:rustc-link-lib=dylib=dl");
}
