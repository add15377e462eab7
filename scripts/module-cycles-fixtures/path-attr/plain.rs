pub fn p() {}
pub fn q() {
    super::renamed::r()
}
