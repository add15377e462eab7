pub fn x() {
    println!("{}", crate::p::val());
}
pub fn y() -> bool {
    true
}
